import { ABCWidgetFactory, DocumentRegistry, DocumentWidget } from '@jupyterlab/docregistry';
import { ServerConnection } from '@jupyterlab/services';
import { URLExt } from '@jupyterlab/coreutils';
import { Widget } from '@lumino/widgets';

import { DRAWERS, pageModel } from './views';

export const TRACE_FILE_TYPE = 'sharddbg-trace';
export const COLUMNAR_TRACE_FILE_TYPE = 'sharddbg-trace-columns';
export const JOB_FILE_TYPE = 'sharddbg-job';
export const JOB_STREAM_FILE_TYPE = 'sharddbg-job-stream';
export const JOB_RECORD_FILE_TYPE = 'sharddbg-job-record';
export const TRACE_FACTORY = 'sharddbg trace';
/** The same views for the binary files (Arrow): their document context must read them as base64, not text. */
export const BINARY_TRACE_FACTORY = 'sharddbg trace (Arrow)';
/** A recorded job's rank files (``sharddbg record``: rank-NNNNN.arrows, Arrow IPC streams; rank-NNNNN.jsonl in
 *  older folders): a double-click opens the whole job. */
export const JOB_FILE_PATTERN = '^rank-\\d{5,}\\.jsonl$';
export const JOB_STREAM_FILE_PATTERN = '^rank-\\d{5,}\\.arrows$';
/** The job's own record (job.json): opens the whole job through "Open With" only, since other tools name
 *  their files job.json too and a double-click keeps opening those in the editor. */
export const JOB_RECORD_FILE_PATTERN = '^job\\.json$';

/** What the server answers for a trace (sharddbg/labserver.py ``trace_answer``). */
interface ITraceAnswer {
  views?: { view: string; drawn: unknown }[];
  html?: string;
  error?: string;
}

const TITLES: { [view: string]: string } = {
  explorer: 'explorer',
  timeline: 'timeline',
  comm: 'communication per op'
};

/** The server's URL for a file under its root opened as a trace (a trace file, or a recorded job's file). */
export function traceFileUrl(path: string): string {
  return URLExt.join(ServerConnection.makeSettings().baseUrl, 'sharddbg', 'trace') + '?path=' + encodeURIComponent(path);
}

/** A trace drawn with its views: the explorer, the timeline and communication per op. The server reads and
 *  checks the trace (the same ``load_trace`` and analyses as the notebook's views) and sends what each view
 *  draws; this side only draws. Nothing is written. */
export class TraceView extends Widget {
  constructor(private url: string) {
    super();
    this.addClass('sd-ext-document');
    this.node.tabIndex = -1;
  }

  async load(): Promise<void> {
    const settings = ServerConnection.makeSettings();
    let answer: ITraceAnswer;
    try {
      const response = await ServerConnection.makeRequest(this.url, {}, settings);
      if (response.ok) {
        answer = (await response.json()) as ITraceAnswer;
      } else {
        let why = '';
        try {
          why = ((await response.json()) as { message?: string }).message ?? '';
        } catch {
          why = '';
        }
        answer = { error: `the server answered ${response.status} ${why || response.statusText} (is sharddbg's server extension enabled?)` };
      }
    } catch (err) {
      answer = { error: `the server could not be asked (${String(err)})` };
    }
    this.node.replaceChildren();
    if (answer.error !== undefined || !Array.isArray(answer.views) || !answer.views.length) {
      const error = document.createElement('pre');
      error.className = 'sd-ext-error';
      error.textContent = answer.error ?? 'the server sent no data for this trace';
      this.node.append(error);
      this.node.dataset.sdDrawnBy = 'error';
      return;
    }
    let failed = 0;
    for (const { view, drawn } of answer.views) {
      const section = document.createElement('section');
      section.className = `sd-ext-section sd-ext-section-${view}`;
      section.dataset.sdView = view;
      const head = document.createElement('h3');
      head.className = 'sd-ext-section-title';
      head.textContent = TITLES[view] ?? view;
      const host = document.createElement('div');
      host.className = 'sd-ext-live';
      section.append(head, host);
      this.node.append(section);
      try {
        if (!(view in DRAWERS)) {
          throw new Error(`the view ${JSON.stringify(view)} is not one this extension draws`);
        }
        DRAWERS[view](pageModel(drawn), host);
      } catch (err) {
        host.textContent = `sharddbg: the ${TITLES[view] ?? view} could not be drawn (${String(err)})`;
        failed += 1;
      }
    }
    this.node.dataset.sdDrawnBy = failed === answer.views.length ? 'error' : 'extension';
  }
}

/** Opens trace files (``*.sdtrace.json``) and recorded jobs (their job.json or rank files) as
 *  :class:`TraceView` documents (the default for them: a double-click). */
export class TraceViewFactory extends ABCWidgetFactory<DocumentWidget<TraceView>> {
  protected createNewWidget(context: DocumentRegistry.Context): DocumentWidget<TraceView> {
    const content = new TraceView(traceFileUrl(context.path));
    // the server reads the trace itself (a job: its whole folder): no need to wait for the file's text
    void content.load();
    const widget = new DocumentWidget({ content, context });
    widget.title.caption = `${context.path} (sharddbg trace)`;
    return widget;
  }
}
