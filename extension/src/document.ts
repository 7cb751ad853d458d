import { ABCWidgetFactory, DocumentRegistry, DocumentWidget } from '@jupyterlab/docregistry';
import { ServerConnection } from '@jupyterlab/services';
import { URLExt } from '@jupyterlab/coreutils';
import { Widget } from '@lumino/widgets';

import { DRAWERS, pageModel } from './views';

export const TRACE_FILE_TYPE = 'sharddbg-trace';
export const TRACE_FACTORY = 'sharddbg trace';

/** What the server answers for a trace file (sharddbg/labserver.py). */
interface ITraceAnswer {
  drawn?: unknown;
  html?: string;
  error?: string;
}

/** A trace file drawn by the explorer. The server reads and checks the file (the same ``load_trace`` and
 *  analysis as the notebook's views); this side only draws. The file itself is never written. */
export class TraceView extends Widget {
  constructor(private context: DocumentRegistry.Context) {
    super();
    this.addClass('sd-ext-document');
    this.node.tabIndex = -1;
    void context.ready.then(() => this.load());
  }

  async load(): Promise<void> {
    const settings = ServerConnection.makeSettings();
    const url = URLExt.join(settings.baseUrl, 'sharddbg', 'trace') + '?path=' + encodeURIComponent(this.context.path);
    let answer: ITraceAnswer;
    try {
      const response = await ServerConnection.makeRequest(url, {}, settings);
      answer = response.ok
        ? ((await response.json()) as ITraceAnswer)
        : { error: `the server answered ${response.status} ${response.statusText} (is sharddbg's server extension enabled?)` };
    } catch (err) {
      answer = { error: `the server could not be asked (${String(err)})` };
    }
    this.node.replaceChildren();
    if (answer.error !== undefined || answer.drawn === undefined) {
      const error = document.createElement('pre');
      error.className = 'sd-ext-error';
      error.textContent = answer.error ?? 'the server sent no data for this file';
      this.node.append(error);
      this.node.dataset.sdDrawnBy = 'error';
      return;
    }
    const host = document.createElement('div');
    host.className = 'sd-ext-live';
    this.node.append(host);
    try {
      DRAWERS.explorer(pageModel(answer.drawn), host);
      this.node.dataset.sdDrawnBy = 'extension';
    } catch (err) {
      host.textContent = `sharddbg: the trace could not be drawn (${String(err)})`;
      this.node.dataset.sdDrawnBy = 'error';
    }
  }
}

/** Opens ``*.sdtrace.json`` files as :class:`TraceView` documents (the default for them: a double-click). */
export class TraceViewFactory extends ABCWidgetFactory<DocumentWidget<TraceView>> {
  protected createNewWidget(context: DocumentRegistry.Context): DocumentWidget<TraceView> {
    const widget = new DocumentWidget({ content: new TraceView(context), context });
    widget.title.caption = `${context.path} (sharddbg trace)`;
    return widget;
  }
}
