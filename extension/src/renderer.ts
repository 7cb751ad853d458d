import { INotebookTracker } from '@jupyterlab/notebook';
import { IRenderMime, renderHTML } from '@jupyterlab/rendermime';
import { Widget } from '@lumino/widgets';

import { readPayload, VIEW_MIMETYPE } from './payload';
import { DRAWERS, pageModel } from './views';

const WIDGET_MIMETYPE = 'application/vnd.jupyter.widget-view+json';

/** Draws a sharddbg view from the payload saved in its output bundle: live (filters, hover, click-through)
 *  with the views' own modules and no kernel. A bundle whose widget is alive in this notebook's kernel shows
 *  that widget instead (its selection reaches Python). A payload that cannot be drawn shows the bundle's
 *  static HTML under one line saying why. */
export class ViewRenderer extends Widget implements IRenderMime.IRenderer {
  constructor(
    private options: IRenderMime.IRendererOptions,
    private notebooks: INotebookTracker | null
  ) {
    super();
    this.addClass('sd-ext-view');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    this.model = model;
    const read = readPayload(model.data[VIEW_MIMETYPE]);
    this.node.replaceChildren();
    if ('reason' in read) {
      return this.renderStatic(model, read.reason);
    }
    const host = document.createElement('div');
    host.className = 'sd-ext-live';
    try {
      DRAWERS[read.view](pageModel(read.drawn), host);
    } catch (err) {
      // saved data that does not hold what the view draws (edited, truncated): the static view, and why
      return this.renderStatic(model, `the view could not be drawn from its saved data (${String(err)})`);
    }
    this.node.dataset.sdView = read.view;
    this.node.dataset.sdDrawnBy = 'extension';
    this.node.append(host);
    if (this.isAttached) {
      void this.preferLiveWidget();
    }
  }

  protected onAfterAttach(): void {
    void this.preferLiveWidget();
  }

  protected onBeforeDetach(): void {
    this.restoredFrom?.restored?.disconnect(this.onRestored, this);
  }

  dispose(): void {
    this.live?.dispose();
    super.dispose();
  }

  private async renderStatic(model: IRenderMime.IMimeModel, reason: string): Promise<void> {
    const why = document.createElement('div');
    why.className = 'sd-ext-why';
    why.textContent = `sharddbg: drawn from its static copy: ${reason}.`;
    const html = document.createElement('div');
    html.className = 'sd-ext-static';
    this.node.replaceChildren(why, html);
    this.node.dataset.sdDrawnBy = 'static';
    const source = model.data['text/html'];
    if (typeof source !== 'string') {
      html.textContent = typeof model.data['text/plain'] === 'string' ? (model.data['text/plain'] as string) : '';
      return;
    }
    await renderHTML({
      host: html,
      source,
      trusted: model.trusted,
      sanitizer: this.options.sanitizer,
      resolver: this.options.resolver,
      linkHandler: this.options.linkHandler,
      shouldTypeset: false,
      latexTypesetter: this.options.latexTypesetter,
      translator: this.options.translator
    });
  }

  /** The notebook's live widget in place of the saved drawing, when its kernel holds the widget's model. */
  private async preferLiveWidget(): Promise<void> {
    const model = this.model;
    const source = model?.data[WIDGET_MIMETYPE] as { model_id?: string } | undefined;
    if (!model || this.live || !source?.model_id || !this.notebooks || this.node.dataset.sdDrawnBy !== 'extension') {
      return;
    }
    const panel = this.notebooks.find(p => p.node.contains(this.node));
    const factory = panel?.content.rendermime.getFactory(WIDGET_MIMETYPE);
    if (!panel || !factory) {
      return;
    }
    // the widget's renderer reads the bundle under its own MIME type
    const renderer = factory.createRenderer({ ...this.options, mimeType: WIDGET_MIMETYPE }) as IRenderMime.IRenderer & { _manager?: { promise: Promise<any> } };
    let manager: any;
    try {
      manager = await renderer._manager?.promise;
    } catch {
      manager = undefined;
    }
    if (!manager || typeof manager.has_model !== 'function') {
      renderer.dispose();
      return;
    }
    if (!manager.has_model(source.model_id)) {
      renderer.dispose();
      // a widget state restored later (a notebook saved with its widget state) brings the model back
      if (manager.restored && this.restoredFrom !== manager) {
        this.restoredFrom = manager;
        manager.restored.connect(this.onRestored, this);
      }
      return;
    }
    if (this.live || this.isDisposed || !this.isAttached) {
      renderer.dispose();
      return;
    }
    this.live = renderer;
    this.node.replaceChildren();
    this.node.dataset.sdDrawnBy = 'widget';
    Widget.attach(renderer, this.node);
    await renderer.renderModel(model);
    if (renderer.node.textContent?.startsWith('Error displaying widget')) {
      // the kernel let the model go meanwhile: the saved drawing again
      this.live = null;
      Widget.detach(renderer);
      renderer.dispose();
      await this.renderModel(model);
    }
  }

  private onRestored(): void {
    void this.preferLiveWidget();
  }

  private model: IRenderMime.IMimeModel | null = null;
  private live: IRenderMime.IRenderer | null = null;
  private restoredFrom: any = null;
}

/** The renderer factory: ahead of the widget's own (rank -10 in every notebook), safe (every string from the
 *  payload is set as text; the static HTML goes through the sanitizer when the notebook is not trusted). */
export function viewRendererFactory(notebooks: INotebookTracker | null): IRenderMime.IRendererFactory {
  return {
    safe: true,
    mimeTypes: [VIEW_MIMETYPE],
    defaultRank: -20,
    createRenderer: options => new ViewRenderer(options, notebooks)
  };
}
