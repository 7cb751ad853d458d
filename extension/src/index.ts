import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { MainAreaWidget } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';

import { ClusterPanel } from './panel';
import { BINARY_TRACE_FACTORY, COLUMNAR_TRACE_FILE_TYPE, JOB_FILE_PATTERN, JOB_FILE_TYPE, JOB_RECORD_FILE_PATTERN, JOB_RECORD_FILE_TYPE, JOB_STREAM_FILE_PATTERN, JOB_STREAM_FILE_TYPE, TRACE_FACTORY, TRACE_FILE_TYPE, TraceView, TraceViewFactory } from './document';
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

/** ``*.sdtrace.json``, ``*.sdtrace.arrow`` and recorded jobs (``rank-NNNNN.arrows`` or ``.jsonl`` by a double-click,
 *  ``job.json`` through Open With) opened as documents with the explorer, the timeline and communication per op.
 *  The server reads the file (``load_trace``); the binary ones have a factory of their own whose document context
 *  reads them as base64 (as text they would fail to load as "not UTF-8 encoded"). */
const traceFiles: JupyterFrontEndPlugin<void> = {
  id: 'sharddbg-jupyterlab:trace-files',
  description: 'sharddbg trace files and recorded jobs opened with the views',
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
    app.docRegistry.addFileType({
      name: COLUMNAR_TRACE_FILE_TYPE,
      displayName: 'sharddbg trace (columns)',
      extensions: ['.sdtrace.arrow'],
      mimeTypes: ['application/vnd.apache.arrow.file'],
      contentType: 'file',
      fileFormat: 'base64'
    });
    app.docRegistry.addFileType({
      name: JOB_STREAM_FILE_TYPE,
      displayName: 'sharddbg recorded job',
      extensions: [],
      pattern: JOB_STREAM_FILE_PATTERN,
      mimeTypes: ['application/vnd.apache.arrow.stream'],
      contentType: 'file',
      fileFormat: 'base64'
    });
    app.docRegistry.addFileType({
      name: JOB_FILE_TYPE,
      displayName: 'sharddbg recorded job',
      extensions: [],
      pattern: JOB_FILE_PATTERN,
      mimeTypes: ['application/json'],
      contentType: 'file',
      fileFormat: 'text'
    });
    app.docRegistry.addFileType({
      name: JOB_RECORD_FILE_TYPE,
      displayName: 'sharddbg recorded job',
      extensions: [],
      pattern: JOB_RECORD_FILE_PATTERN,
      mimeTypes: ['application/json'],
      contentType: 'file',
      fileFormat: 'text'
    });
    app.docRegistry.addWidgetFactory(
      new TraceViewFactory({
        name: TRACE_FACTORY,
        label: 'sharddbg trace views',
        fileTypes: [TRACE_FILE_TYPE, JOB_FILE_TYPE, JOB_RECORD_FILE_TYPE],
        defaultFor: [TRACE_FILE_TYPE, JOB_FILE_TYPE],
        readOnly: true
      })
    );
    app.docRegistry.addWidgetFactory(
      new TraceViewFactory({
        name: BINARY_TRACE_FACTORY,
        label: 'sharddbg trace views',
        modelName: 'base64',
        fileTypes: [COLUMNAR_TRACE_FILE_TYPE, JOB_STREAM_FILE_TYPE],
        defaultFor: [COLUMNAR_TRACE_FILE_TYPE, JOB_STREAM_FILE_TYPE],
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
    // a cluster's last trace, in the main area: the server reads the file its owner saved
    const openTrace = (clusterId: string, label: string) => {
      const url = URLExt.join(ServerConnection.makeSettings().baseUrl, 'sharddbg', 'clusters',
                              encodeURIComponent(clusterId), 'trace');
      const content = new TraceView(url);
      void content.load();
      const widget = new MainAreaWidget({ content });
      widget.id = `sharddbg-last-trace-${clusterId}-${Date.now()}`;
      widget.title.label = `last trace of ${clusterId}`;
      widget.title.caption = `the last trace of cluster ${clusterId} (${label})`;
      widget.title.closable = true;
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
    };
    const panel = new ClusterPanel(openTrace);
    panel.title.iconClass = 'sd-ext-panel-icon';
    shell.add(panel, 'left', { rank: 900 });
  }
};

export default [views, traceFiles, clusters];
