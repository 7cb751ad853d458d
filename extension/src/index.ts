import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';

import { ClusterPanel } from './panel';
import { TRACE_FACTORY, TRACE_FILE_TYPE, TraceViewFactory } from './document';
import { viewRendererFactory } from './renderer';

/** sharddbg's views drawn from the payload saved in their output bundles: a notebook without its kernel,
 *  or opened in another JupyterLab, shows them live. */
const views: JupyterFrontEndPlugin<void> = {
  id: 'sharddbg-jupyterlab:views',
  description: "sharddbg's views drawn from the data saved with the notebook",
  autoStart: true,
  requires: [IRenderMimeRegistry],
  optional: [INotebookTracker],
  activate: (app: JupyterFrontEnd, rendermime: IRenderMimeRegistry, notebooks: INotebookTracker | null) => {
    const factory = viewRendererFactory(notebooks);
    rendermime.addFactory(factory, factory.defaultRank);
  }
};

/** ``*.sdtrace.json`` opened as a document (a double-click in the file browser) with the explorer. */
const traceFiles: JupyterFrontEndPlugin<void> = {
  id: 'sharddbg-jupyterlab:trace-files',
  description: 'sharddbg trace files opened with the explorer',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    app.docRegistry.addFileType({
      name: TRACE_FILE_TYPE,
      displayName: 'sharddbg trace',
      extensions: ['.sdtrace.json'],
      mimeTypes: ['application/json'],
      contentType: 'file',
      fileFormat: 'text'
    });
    app.docRegistry.addWidgetFactory(
      new TraceViewFactory({
        name: TRACE_FACTORY,
        label: 'sharddbg trace explorer',
        fileTypes: [TRACE_FILE_TYPE],
        defaultFor: [TRACE_FILE_TYPE],
        readOnly: true
      })
    );
  }
};

/** The left side bar's cluster panel. */
const clusters: JupyterFrontEndPlugin<void> = {
  id: 'sharddbg-jupyterlab:clusters',
  description: "this user's sharddbg clusters, live",
  autoStart: true,
  optional: [ILabShell],
  activate: (app: JupyterFrontEnd, shell: ILabShell | null) => {
    if (!shell) {
      return;
    }
    const panel = new ClusterPanel();
    panel.title.iconClass = 'sd-ext-panel-icon';
    shell.add(panel, 'left', { rank: 900 });
  }
};

export default [views, traceFiles, clusters];
