import type { IViewModel } from './views';
// @ts-ignore: a plain ES module shared with the standalone report
import { attachTimelineZoom } from '../../sharddbg/views/_static/timeline_zoom.js';

/** The part of plotly.js this extension calls. */
interface IPlotly {
  newPlot(el: HTMLElement, data: unknown[], layout: object, config: object): Promise<HTMLElement>;
  Plots: { resize(el: HTMLElement): void };
}

let plotly: Promise<IPlotly> | null = null;

/** plotly.js, loaded once, on the first figure drawn (its own chunk: a page without a figure never loads it). */
function loadPlotly(): Promise<IPlotly> {
  if (plotly === null) {
    // @ts-ignore: plotly.js-dist-min has no type declarations
    plotly = import('plotly.js-dist-min').then((m: any) => (m.default ?? m) as IPlotly);
  }
  return plotly;
}

/** A figure the Python side made (``sharddbg/views/figure.py``: plotly's JSON of it), drawn by plotly.js as it
 *  is: hover, zoom and the legend work; nothing is computed here. */
export function drawFigure(model: IViewModel, el: HTMLElement): void {
  const drawn = model.get('data') as { figure?: { data?: unknown; layout?: unknown } } | undefined;
  const figure = drawn?.figure;
  if (!figure || !Array.isArray(figure.data) || figure.layout === null || typeof figure.layout !== 'object') {
    throw new Error('the saved figure has no data or layout');
  }
  const plot = document.createElement('div');
  plot.className = 'sd-ext-figure';
  el.append(plot);
  const loading = loadPlotly();
  loading.catch(() => undefined); // said on the figure once it is drawn
  // drawn once it is laid out with a width (an output rendered before it is attached, a document's tab not
  // shown yet), then drawn again at each new width
  let width = 0;
  let started = false;
  new ResizeObserver(() => {
    if (plot.clientWidth === 0 || plot.clientWidth === width) {
      return;
    }
    width = plot.clientWidth;
    if (started) {
      void loading.then(Plotly => Plotly.Plots.resize(plot)).catch(() => undefined);
      return;
    }
    started = true;
    loading
      .then(Plotly =>
        Plotly.newPlot(plot, figure.data as unknown[], figure.layout as object,
                       { responsive: true, displaylogo: false, showSendToCloud: false }))
      .then(() => {
        plot.dataset.sdDrawn = 'true';
        // a big trace's timeline: any window zoomed into is drawn span by span from the spans it carries
        void loading.then(Plotly => attachTimelineZoom(plot, Plotly)).catch(() => undefined);
      })
      .catch(err => {
        plot.textContent = `sharddbg: the figure could not be drawn (${String(err)})`;
        plot.dataset.sdDrawn = 'error';
      });
  }).observe(plot);
}
