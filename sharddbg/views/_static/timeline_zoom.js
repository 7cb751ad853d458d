// The timeline's zoom, drawn in the page: a big trace's overview carries every span as compact columns
// (layout.meta.sd_zoom, made by sharddbg/views/timeline.py zoom_events); zoomed in to a window of at most
// draw_up_to spans, those spans are drawn one by one on a canvas laid over the plot area, after each plotly draw
// (a plotly restyle would recompute and redraw the whole figure: seconds on a big overview), with a hover of
// its own. No kernel is asked. Used by the standalone report and by the JupyterLab extension's figures.

// URL-safe base64 of zlib-deflated bytes -> Uint8Array
async function inflate(text) {
  const raw = atob(text.replace(/-/g, "+").replace(/_/g, "/"));
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

// the columns as typed arrays: start and end (ms), and the codes of row, category and name; sorted by start,
// with the running maximum of the ends (the spans overlapping [a, b] lie between two binary searches)
async function decode(z) {
  const bytes = await inflate(z.columns);
  const n = z.n, view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const start = new Float64Array(n), end = new Float64Array(n), maxEnd = new Float64Array(n);
  const row = new Uint16Array(n), cat = new Uint8Array(n), name = new Uint16Array(n);
  let at = 0, ticks = 0, reach = -Infinity;
  for (let i = 0; i < n; i++, at += 4) {
    ticks += view.getUint32(at, true);
    start[i] = z.origin_ms + ticks * z.tick_ms;
  }
  for (let i = 0; i < n; i++, at += 4) {
    end[i] = start[i] + view.getUint32(at, true) * z.tick_ms;
    reach = Math.max(reach, end[i]);
    maxEnd[i] = reach;
  }
  for (let i = 0; i < n; i++, at += 2) row[i] = view.getUint16(at, true);
  for (let i = 0; i < n; i++, at += 1) cat[i] = bytes[at];
  for (let i = 0; i < n; i++, at += 2) name[i] = view.getUint16(at, true);
  return { n, start, end, maxEnd, row, cat, name };
}

// the spans of a figure's sd_zoom, decoded (a promise)
export function decodeSpans(z) { return decode(z); }

// the first index in [lo, hi) where arr[i] > value (arr sorted increasing)
function upper(arr, value, lo, hi) {
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (arr[mid] > value) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// the first index where arr[i] >= value
function lower(arr, value) {
  let lo = 0, hi = arr.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (arr[mid] >= value) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// the spans overlapping [a, b], per category, or null where more than limit of them
export function visibleSpans(ev, a, b, limit, categories) {
  const hi = upper(ev.start, b, 0, ev.n);
  const lo = lower(ev.maxEnd, a);
  const per = categories.map(() => []);
  let count = 0;
  for (let i = lo; i < hi; i++) {
    if (ev.end[i] < a) continue;
    if (++count > limit) return null;
    per[ev.cat[i]].push(i);
  }
  return per;
}

function fmt(ms) { return ms.toFixed(3); }

// plain text of an HTML-escaped name (drawn on the canvas as text, never as HTML)
function unescaped(text) {
  return text.replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&quot;/g, '"').replace(/&#x27;/g, "'")
    .replace(/&#39;/g, "'").replace(/&amp;/g, "&");
}

// dark text on light span colours, white on dark ones (views/timeline.py _text_color)
function textColor(color) {
  const v = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16) / 255);
  return 0.299 * v[0] + 0.587 * v[1] + 0.114 * v[2] > 0.6 ? "#111111" : "#ffffff";
}

// the categories hidden from the legend (their group's traces "legendonly")
function hiddenCategories(gd, z) {
  const hidden = new Set();
  for (const t of gd._fullData || []) {
    if (t.visible === "legendonly" && t.legendgroup) hidden.add(t.legendgroup);
  }
  return z.groups.map((g) => hidden.has(g));
}

// Draw the zoomed window of gd (a plotly graph div whose layout.meta.sd_zoom holds the spans) after each of its
// draws. Plotly: the plotly.js object that drew it (unused: the canvas is the page's own; kept for the callers).
export function attachTimelineZoom(gd, Plotly) {
  const z = gd && gd.layout && gd.layout.meta && gd.layout.meta.sd_zoom;
  if (!z || gd._sdZoomAttached) return null;
  gd._sdZoomAttached = true;
  const events = decode(z);
  const canvas = document.createElement("canvas");
  canvas.className = "sd-timeline-zoom";
  canvas.style.cssText = "position:absolute;pointer-events:none;left:0;top:0";
  const tip = document.createElement("div");
  tip.className = "sd-timeline-zoom-tip";
  tip.style.cssText = "position:fixed;display:none;pointer-events:none;z-index:1000;padding:4px 6px;" +
    "font:12px sans-serif;border-radius:3px;color:#fff;max-width:480px";
  document.body.appendChild(tip);
  let drawn = [];  // the spans on the canvas: [index, x0 px, x1 px, y px, half px]
  let ev = null;
  const draw = () => {
    const t0 = performance.now();
    paint();
    gd._sdZoomDrawMs = performance.now() - t0;  // how long the spans took to draw (the bench reads it)
  };
  const paint = () => {
    const L = gd._fullLayout;
    if (!ev || !L || !L.xaxis || !L.yaxis) return;
    const container = gd.querySelector(".svg-container") || gd;
    if (canvas.parentNode !== container) {
      container.style.position = container.style.position || "relative";
      container.appendChild(canvas);
    }
    const s = L._size, dpr = window.devicePixelRatio || 1;
    canvas.style.left = s.l + "px"; canvas.style.top = s.t + "px";
    canvas.style.width = s.w + "px"; canvas.style.height = s.h + "px";
    if (canvas.width !== Math.round(s.w * dpr)) canvas.width = Math.round(s.w * dpr);
    if (canvas.height !== Math.round(s.h * dpr)) canvas.height = Math.round(s.h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, s.w, s.h);
    drawn = [];
    const [r0, r1] = L.xaxis.range;
    const per = visibleSpans(ev, Math.min(r0, r1), Math.max(r0, r1), z.draw_up_to, z.categories);
    gd._sdZoomDrawn = 0;
    const hoverLayer = gd.querySelector(".hoverlayer");
    if (per === null) {  // too many spans to draw one by one: the overview's bins say enough
      if (hoverLayer) hoverLayer.style.display = "";
      return;
    }
    // the spans replace the overview's bins in the window: the plot's background over them, the ranks' separators
    ctx.fillStyle = L.plot_bgcolor || "#fff";
    ctx.fillRect(0, 0, s.w, s.h);
    for (const sh of L.shapes || []) {
      if (sh.type === "line" && sh.yref === "y" && sh.y0 === sh.y1) {
        ctx.fillStyle = (sh.line && sh.line.color) || "#ddd";
        ctx.fillRect(0, Math.round(L.yaxis.l2p(sh.y0)), s.w, 1);
      }
    }
    if (hoverLayer) hoverLayer.style.display = "none";  // the bins' hover: ours instead
    const hidden = hiddenCategories(gd, z);
    ctx.font = "10px sans-serif";
    ctx.textBaseline = "middle";
    per.forEach((idx, k) => {
      if (hidden[k]) return;
      const half = z.bar_px[z.collective[k] ? 1 : 0] / 2;
      for (const i of idx) {
        const x0 = Math.max(L.xaxis.l2p(ev.start[i]), -2), x1 = Math.min(L.xaxis.l2p(ev.end[i]), s.w + 2);
        const y = L.yaxis.l2p(z.rows[ev.row[i]]);
        ctx.fillStyle = z.colors[k];
        ctx.fillRect(x0, y - half, Math.max(x1 - x0, 1), 2 * half);
        drawn.push([i, x0, Math.max(x1, x0 + 1), y, half, k]);
      }
    });
    // an op's name inside its span where it fits (the last dotted part, as the span-by-span figure draws it)
    const labels = new Map();
    for (const [i, x0, x1, y, , k] of drawn) {
      if (z.collective[k] || x1 - x0 < 24) continue;
      const code = ev.name[i];
      if (!labels.has(code)) labels.set(code, unescaped(z.names[code]).split(".").pop());
      const text = labels.get(code), width = ctx.measureText(text).width;
      if (width + 6 > x1 - x0) continue;
      ctx.fillStyle = textColor(z.colors[k]);
      ctx.fillText(text, (x0 + x1) / 2 - width / 2, y);
    }
    gd._sdZoomDrawn = drawn.length;
  };
  const hover = (e) => {
    const L = gd._fullLayout;
    if (!drawn.length || !L || !L._size) { tip.style.display = "none"; return; }
    const box = canvas.getBoundingClientRect(), px = e.clientX - box.left, py = e.clientY - box.top;
    let hit = null;
    for (const d of drawn) {
      if (px >= d[1] - 2 && px <= d[2] + 2 && Math.abs(py - d[3]) <= d[4] + 1) { hit = d; }
    }
    if (hit === null) { tip.style.display = "none"; return; }
    const i = hit[0], k = hit[5], s = ev.start[i], t = ev.end[i];
    // the names and categories are HTML-escaped by the Python side, as plotly's own hover text is
    tip.innerHTML = `<b>${z.names[ev.name[i]]}</b> · rank ${Math.round(z.rows[ev.row[i]])}<br>` +
      `${z.collective[k] ? "collective" : z.categories[k]} · ${fmt(s)}–${fmt(t)} ms (${fmt(t - s)} ms)`;
    tip.style.background = z.colors[k];
    tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px";
    tip.style.display = "block";
  };
  gd.addEventListener("mousemove", hover);
  gd.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  gd._sdZoomPending = events.then((decoded) => { ev = decoded; draw(); });
  gd.on("plotly_afterplot", draw);  // every plotly draw: a zoom, a pan, a resize, a legend click
  gd.on("plotly_relayout", draw);
  return gd._sdZoomPending;
}

export default { attach: attachTimelineZoom };
