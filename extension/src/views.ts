// The views' own front end (sharddbg/views/_static), bundled here as it is: the anywidget widgets run the
// same modules, so a view drawn by this extension is the widget's drawing, not a second one.
// @ts-ignore: plain ES modules without type declarations
import { renderExplorer } from '../../sharddbg/views/_static/explorer.js';
// @ts-ignore
import { renderInspector } from '../../sharddbg/views/_static/inspector.js';

import { drawFigure } from './figure';
import { drawTable } from './table';

/** What the views' modules read and write: an anywidget model, here one that lives in the page only. */
export interface IViewModel {
  get(name: string): unknown;
  set(name: string, value: unknown): void;
  save_changes(): void;
  on(event: string, callback: () => void): void;
}

/** A model over saved data: ``data`` is what the widget's ``data`` trait held; changes stay in the page. */
export function pageModel(data: unknown): IViewModel {
  const values = new Map<string, unknown>([['data', data]]);
  return {
    get: (name: string) => values.get(name),
    set: (name: string, value: unknown) => {
      values.set(name, value);
    },
    save_changes: () => undefined,
    on: () => undefined
  };
}

type Draw = (model: IViewModel, el: HTMLElement) => void;

/** The views this extension draws, by the payload's ``view``: the widgets' own modules, plotly.js for the
 *  figures (the timeline, communication per op, the check's error per row, the smoke's losses), and the
 *  verification views' tables. */
export const DRAWERS: { [view: string]: Draw } = {
  explorer: renderExplorer as Draw,
  inspector: renderInspector as Draw,
  timeline: drawFigure,
  comm: drawFigure,
  check_rows: drawFigure,
  smoke_losses: drawFigure,
  check: drawTable,
  doctor: drawTable,
  smoke: drawTable
};
