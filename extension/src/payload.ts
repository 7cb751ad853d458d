import { DRAWERS } from './views';

/** The MIME type of a view's payload in its output bundle (sharddbg/views/bundle.py). */
export const VIEW_MIMETYPE = 'application/vnd.sharddbg.trace+json';
export const PAYLOAD_FORMAT = 'sharddbg.view';
/** The newest payload version this extension reads. */
export const PAYLOAD_VERSION = 1;

/** A payload this extension can draw: the view's name and what its front end draws. */
export interface IDrawable {
  view: string;
  drawn: unknown;
}

/** Why a payload is not drawn: one line, shown above the view's static rendering. */
export interface IUndrawable {
  reason: string;
}

/** The payload read, or the one-line reason it cannot be drawn. Never throws. */
export function readPayload(payload: unknown): IDrawable | IUndrawable {
  if (payload === null || typeof payload !== 'object' || Array.isArray(payload)) {
    return { reason: `the view's data is not an object (${payload === null ? 'null' : typeof payload})` };
  }
  const p = payload as { [key: string]: unknown };
  if (p.format !== PAYLOAD_FORMAT) {
    return { reason: `the view's data is of format ${JSON.stringify(p.format ?? null)}, not ${PAYLOAD_FORMAT}` };
  }
  if (typeof p.version !== 'number' || !Number.isInteger(p.version)) {
    return { reason: `the view's data has no version number (version ${JSON.stringify(p.version ?? null)})` };
  }
  if (p.version > PAYLOAD_VERSION) {
    return {
      reason: `the view was saved by a newer sharddbg (data version ${p.version}; this extension reads up to ` +
        `${PAYLOAD_VERSION}): update sharddbg to draw it`
    };
  }
  const view = typeof p.view === 'string' ? p.view : '';
  if (!(view in DRAWERS)) {
    return { reason: `the view ${JSON.stringify(p.view ?? null)} is not one this extension draws` };
  }
  if (p.drawn === null && typeof p.note === 'string') {
    return { reason: p.note };
  }
  const drawn = p.drawn as { [key: string]: unknown } | undefined;
  if (drawn === undefined) {
    return { reason: 'the view was saved by an older sharddbg, without the data its front end draws' };
  }
  if (drawn === null || typeof drawn !== 'object' || Array.isArray(drawn)) {
    return { reason: "the view's drawn data is not an object: the saved output may be truncated or edited" };
  }
  return { view, drawn };
}
