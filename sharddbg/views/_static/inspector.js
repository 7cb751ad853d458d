// sharddbg shard inspector: draws model.get("data") (ShardLayout.to_json()) as a block diagram + table.
// Every string from the data is set with textContent / setAttribute (never innerHTML): it is shown as text.
// Labels are placed only where they fit (inside their block; ticks apart from each other), so no two overlap.
const SVGNS = "http://www.w3.org/2000/svg";
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
                 "#86bcb6", "#e15759", "#8cd17d", "#d4a6c8"];

function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}
function s(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  return e;
}
const shp = (a) => "(" + a.join(", ") + (a.length === 1 ? "," : "") + ")";
const ranksText = (rs) => rs.length === 1 ? `rank ${rs[0]}`
  : rs.every((r, i) => i === 0 || r === rs[i - 1] + 1) ? `ranks ${rs[0]}-${rs[rs.length - 1]}` : `ranks ${rs.join(",")}`;

// text width in px, measured with the page's UI font (a little generous: the test of overlaps measures real boxes)
let measureCtx = null;
function textWidth(text, px, bold) {
  if (!measureCtx) measureCtx = document.createElement("canvas").getContext("2d");
  const family = getComputedStyle(document.documentElement).getPropertyValue("--jp-ui-font-family").trim() ||
    "system-ui, -apple-system, Segoe UI, Roboto, sans-serif";
  measureCtx.font = `${bold ? "600 " : ""}${px}px ${family}`;
  return measureCtx.measureText(text).width * 1.08 + 2;
}

// tick values whose labels do not collide: the two ends first, then the others in order where there is room
function spacedTicks(values, pos, size) {
  const sorted = [...new Set(values)].sort((a, b) => a - b);
  const kept = [];
  const fits = (t) => kept.every((k) => Math.abs(pos(k) - pos(t)) >= (size(k) + size(t)) / 2 + 3);
  for (const t of [sorted[0], sorted[sorted.length - 1], ...sorted.slice(1, -1)]) if (t !== undefined && fits(t)) kept.push(t);
  return kept;
}

function blockLabels(data, b, rd, cd) {
  const lines = [[ranksText(b.ranks) + (b.partial ? " Σ partial" : ""), 12, true, "sd-block-label"]];
  // the ranks' coordinates on the mesh, when it has more than one dim (ddp=1, domain=0)
  if (b.coordinates.length === 1 && b.coordinates[0].includes(",")) lines.push([b.coordinates[0], 11, false, "sd-block-coord"]);
  const sizes = [];
  if (rd !== null) sizes.push(b.row1 - b.row0);
  if (cd !== null) sizes.push(b.col1 - b.col0);
  const shape = b.local_shapes.length === 1 || b.local_shapes.every((l) => l.join() === b.local_shapes[0].join())
    ? shp(b.local_shapes[0]) : sizes.join(" × ");
  // "uneven" is only a note beside a real problem (the warnings above say what is wrong): not on the block then
  lines.push([shape + (b.uneven && !data.warnings.length ? "  ▼ uneven" : ""), 11, false, "sd-block-shape"]);
  if (b.split_along.length) lines.push([`each its slice of dim ${b.split_along.join(", ")}`, 11, false, "sd-block-shape"]);
  return lines;
}

function diagram(data, pair, groupId) {
  const blocks = pair.blocks.filter((b) => b.group === groupId);
  const [rd, cd] = pair.dims;
  const extent = data.extent || data.global_shape;
  const R = rd === null ? 1 : extent[rd];
  const C = cd === null ? 1 : extent[cd];
  const W = 560, left = 64, top = 34, right = 12, bottom = 10;
  const Hd = rd === null ? 90 : Math.max(150, Math.min(380, (R / Math.max(C, 1)) * W));
  const Wd = W - left - right;
  const facets = [...new Set(blocks.map((b) => b.facet))];
  const wrap = h("div", { class: "sd-facets" });
  for (const facet of facets) {
    const mine = blocks.filter((b) => b.facet === facet);
    const svg = s("svg", { width: W, height: Hd + top + bottom, class: "sd-diagram", role: "img" });
    const defs = s("defs");
    const pat = s("pattern", { id: "sd-hatch", width: 8, height: 8, patternUnits: "userSpaceOnUse",
                               patternTransform: "rotate(45)" });
    pat.append(s("line", { x1: 0, y1: 0, x2: 0, y2: 8, stroke: "rgba(0,0,0,0.28)", "stroke-width": 3 }));
    defs.append(pat);
    svg.append(defs);
    const x = (c) => left + (c / Math.max(C, 1)) * Wd;
    const y = (r) => top + (r / Math.max(R, 1)) * Hd;
    // axes: column dim on top, row dim on the left, ticks at block edges (only those with room)
    if (cd !== null) svg.append(s("text", { x: left, y: 12, class: "sd-axis-title", text: `dim ${cd} (${data.global_shape[cd]}) →` }));
    if (rd !== null) {
      svg.append(s("text", { x: 12, y: top + Hd / 2, class: "sd-axis-title",
                             transform: `rotate(-90 12 ${top + Hd / 2})`, "text-anchor": "middle",
                             text: `dim ${rd} (${data.global_shape[rd]}) ↓` }));
    }
    const rowTicks = [0, R], colTicks = [0, C];
    for (const b of mine) {
      if (b.sharded_rows) rowTicks.push(b.row0, b.row1);
      if (b.sharded_cols) colTicks.push(b.col0, b.col1);
    }
    if (rd !== null) for (const t of spacedTicks(rowTicks, y, () => 12)) svg.append(s("text", { x: left - 6, y: y(t) + 4, class: "sd-tick", "text-anchor": "end", text: String(t) }));
    if (cd !== null) for (const t of spacedTicks(colTicks, x, (t) => textWidth(String(t), 10, false))) svg.append(s("text", { x: x(t), y: top - 6, class: "sd-tick", "text-anchor": "middle", text: String(t) }));
    for (const b of mine) {
      const g = s("g", { class: "sd-block" + (b.uneven ? " sd-uneven" : "") + (b.partial ? " sd-partial" : "") + (b.ok ? "" : " sd-bad") + (b.inferred ? " sd-inferred" : ""),
                         "data-ranks": b.ranks.join(","), "data-local-shape": b.local_shapes[0].join(","),
                         "data-rows": `${b.row0}-${b.row1}`, "data-cols": `${b.col0}-${b.col1}` });
      const X0 = x(b.col0), Y0 = y(b.row0), BW = Math.max(2, x(b.col1) - X0), BH = Math.max(2, y(b.row1) - Y0);
      const color = PALETTE[b.ranks[0] % PALETTE.length];
      g.append(s("rect", { x: X0 + 1, y: Y0 + 1, width: BW - 2, height: BH - 2, rx: 3, fill: color,
                           "fill-opacity": b.partial ? 0.45 : 0.8, stroke: b.ok ? "#333" : "#d32f2f",
                           "stroke-width": b.ok ? 1 : 3, "stroke-dasharray": b.partial ? "6 3" : "" }));
      if (b.uneven) g.append(s("rect", { x: X0 + 1, y: Y0 + 1, width: BW - 2, height: BH - 2, fill: "url(#sd-hatch)",
                                         "fill-opacity": data.warnings.length ? 0.35 : 1 }));
      const title = s("title");
      title.textContent = b.ranks.map((r, i) => `rank ${r}` + (b.coordinates[i] ? ` (${b.coordinates[i]})` : "") + `: local ${shp(b.local_shapes[i])}`).join("\n") +
        `\nrows [${b.row0}, ${b.row1}) cols [${b.col0}, ${b.col1})` + (b.uneven ? "\nuneven: less than the largest shard" : "") +
        (b.split_along.length ? `\neach rank holds its own slice of dim ${b.split_along.join(", ")}` : "") +
        (b.inferred ? "\nlaid out as the ranks hold it: the spec says this dim is whole" : "") +
        (b.ok ? "" : "\nthe spec disagrees with the local tensor");
      g.append(title);
      // as many label lines as fit inside the block, centred
      const lines = [];
      for (const ln of blockLabels(data, b, rd, cd)) {
        if (textWidth(ln[0], ln[1], ln[2]) > BW - 8 || 15 * (lines.length + 1) > BH - 4) break;
        lines.push(ln);
      }
      const cx = X0 + BW / 2, y0 = Y0 + BH / 2 - (15 * lines.length) / 2 + 11;
      lines.forEach(([text, , , cls], i) => g.append(s("text", { x: cx, y: y0 + 15 * i, class: cls, "text-anchor": "middle", text })));
      svg.append(g);
    }
    const box = h("div", { class: "sd-facet" });
    if (facet) box.append(h("div", { class: "sd-facet-title", text: facet }));
    box.append(svg);
    wrap.append(box);
  }
  return wrap;
}

function table(data) {
  const cols = [["rank", "rank"], ["coordinate", "mesh coord"], ["local_shape", "local shape"],
                ["spec_local_shape", "spec says"], ["offsets", "global offsets"], ["local_bytes_text", "memory"],
                ["requires_grad", "requires_grad"], ["device", "device"], ["ok", "check"]];
  const t = h("table", { class: "sd-table sd-ranks" });
  const thead = h("tr");
  for (const [, label] of cols) thead.append(h("th", { text: label }));
  t.append(h("thead", {}, thead));
  const tb = h("tbody");
  for (const r of data.ranks) {
    const tr = h("tr", { "data-rank": r.rank, class: r.ok ? "" : "sd-row-bad" });
    for (const [k] of cols) {
      let v = r[k];
      if (Array.isArray(v)) v = shp(v);
      else if (k === "ok") v = v ? "✓" : "⚠ mismatch";
      else if (v === null || v === undefined || v === "") v = "—";
      tr.append(h("td", { text: String(v), class: "sd-col-" + k }));
    }
    tb.append(tr);
  }
  t.append(tb);
  return t;
}

function meshText(data) {
  const one = (m) => m.dim_names.map((n, i) => `${n}=${m.shape[i]}`).join(" × ");
  if (data.world_mesh && data.mesh && one(data.world_mesh) !== one(data.mesh)) return `mesh ${one(data.mesh)} (the cluster's: ${one(data.world_mesh)})`;
  if (data.world_mesh || data.mesh) return `mesh ${one(data.mesh || data.world_mesh)}`;
  return "not distributed";
}

export function renderInspector(model, el) {
  const root = h("div", { class: "sd-root sd-inspector" });
  el.append(root);
  const draw = () => {
    const data = model.get("data");
    root.replaceChildren();
    if (!data || !data.pairs) return;
    root.append(h("div", { class: "sd-title" },
      h("span", { class: "sd-kind", text: data.kind }), " ",
      h("code", { class: "sd-name", text: data.name }), " ",
      h("span", { class: "sd-meta", text: `global ${shp(data.global_shape)} · ${data.dtype} · ${meshText(data)} · ` +
        `placements ${data.placements.length ? data.placements.join(", ") : "—"} · ${data.ranks.length} ranks · ${data.total_bytes_text} in all` })));
    // the verdict first: what is wrong (the warnings), or that the spec and the data agree; then the drawing
    if (data.warnings.length) {
      const w = h("div", { class: "sd-warnings sd-verdict" });
      if (data.verdict) w.append(h("div", { class: "sd-verdict-line", text: "⚠ " + data.verdict }));
      for (const m of data.warnings) w.append(h("div", { class: "sd-warning", text: "⚠ " + m }));
      root.append(w);
    } else root.append(h("div", { class: "sd-verdict sd-verdict-ok", text: "✓ " + (data.verdict || "spec and data agree") }));
    const sel = h("select", { class: "sd-dims", "aria-label": "dims drawn" });
    data.pairs.forEach((p, i) => sel.append(h("option", { value: String(i), text: p.label })));
    const pi = Math.min(model.get("pair") ?? data.default_pair, data.pairs.length - 1);
    sel.value = String(pi);
    sel.addEventListener("change", () => { model.set("pair", Number(sel.value)); model.save_changes && model.save_changes(); draw(); });
    if (data.pairs.length > 1) root.append(h("label", { class: "sd-control" }, "dims drawn: ", sel));
    const pair = data.pairs[pi];
    const diag = h("div", { class: "sd-groups" });
    for (const g of data.groups) {
      const box = h("div", { class: "sd-group", "data-group": g.id });
      if (data.groups.length > 1) box.append(h("div", { class: "sd-group-title", text: g.label }));
      box.append(diagram(data, pair, g.id));
      diag.append(box);
    }
    root.append(diag);
    const legend = h("div", { class: "sd-legend" },
      h("span", { class: "sd-key sd-key-hatch" }), " uneven (less than the largest shard)   ",
      h("span", { class: "sd-key sd-key-bad" }), " spec disagrees with the local tensor   ",
      h("span", { class: "sd-key sd-key-partial" }), " partial (sum over ranks)");
    root.append(legend);
    root.append(table(data));
    if (data.notes.length) {
      const n = h("div", { class: "sd-notes" });
      for (const m of data.notes) n.append(h("div", { class: "sd-note", text: "ℹ " + m }));
      root.append(n);
    }
  };
  draw();
  model.on && model.on("change:data", draw);
}

export default { render({ model, el }) { renderInspector(model, el); } };
