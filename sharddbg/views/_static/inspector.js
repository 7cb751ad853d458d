// sharddbg shard inspector: draws model.get("data") (ShardLayout.to_json()) as a block diagram + table.
// Every string from the data is set with textContent / setAttribute (never innerHTML): it is shown as text.
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

function diagram(data, pair, groupId) {
  const blocks = pair.blocks.filter((b) => b.group === groupId);
  const [rd, cd] = pair.dims;
  const R = rd === null ? 1 : data.global_shape[rd];
  const C = cd === null ? 1 : data.global_shape[cd];
  const W = 560, left = 64, top = 34, right = 12, bottom = 10;
  const Hd = rd === null ? 90 : Math.max(150, Math.min(380, (R / Math.max(C, 1)) * W));
  const Wd = W - left - right;
  const facets = [...new Set(blocks.map((b) => b.facet))];
  const wrap = h("div", { class: "sd-facets" });
  for (const facet of facets) {
    const svg = s("svg", { width: W, height: Hd + top + bottom, class: "sd-diagram", role: "img" });
    const defs = s("defs");
    const pat = s("pattern", { id: "sd-hatch", width: 8, height: 8, patternUnits: "userSpaceOnUse",
                               patternTransform: "rotate(45)" });
    pat.append(s("line", { x1: 0, y1: 0, x2: 0, y2: 8, stroke: "rgba(0,0,0,0.28)", "stroke-width": 3 }));
    defs.append(pat);
    svg.append(defs);
    const x = (c) => left + (c / Math.max(C, 1)) * Wd;
    const y = (r) => top + (r / Math.max(R, 1)) * Hd;
    // axes: column dim on top, row dim on the left, ticks at block edges
    svg.append(s("text", { x: left, y: 12, class: "sd-axis-title",
                           text: cd === null ? "" : `dim ${cd} (${C}) →` }));
    if (rd !== null) {
      svg.append(s("text", { x: 12, y: top + Hd / 2, class: "sd-axis-title",
                             transform: `rotate(-90 12 ${top + Hd / 2})`, "text-anchor": "middle",
                             text: `dim ${rd} (${R}) ↓` }));
    }
    const rowTicks = new Set([0, R]), colTicks = new Set([0, C]);
    for (const b of blocks.filter((b) => b.facet === facet)) {
      if (b.sharded_rows) { rowTicks.add(b.row0); rowTicks.add(b.row1); }
      if (b.sharded_cols) { colTicks.add(b.col0); colTicks.add(b.col1); }
    }
    if (rd !== null) for (const t of rowTicks) svg.append(s("text", { x: left - 6, y: y(t) + 4, class: "sd-tick", "text-anchor": "end", text: String(t) }));
    for (const t of colTicks) if (cd !== null) svg.append(s("text", { x: x(t), y: top - 6, class: "sd-tick", "text-anchor": "middle", text: String(t) }));
    for (const b of blocks.filter((b) => b.facet === facet)) {
      const g = s("g", { class: "sd-block" + (b.uneven ? " sd-uneven" : "") + (b.partial ? " sd-partial" : "") + (b.ok ? "" : " sd-bad"),
                         "data-ranks": b.ranks.join(","), "data-local-shape": b.local_shapes[0].join(","),
                         "data-rows": `${b.row0}-${b.row1}`, "data-cols": `${b.col0}-${b.col1}` });
      const X0 = x(b.col0), Y0 = y(b.row0), BW = Math.max(2, x(b.col1) - X0), BH = Math.max(2, y(b.row1) - Y0);
      const color = PALETTE[b.ranks[0] % PALETTE.length];
      g.append(s("rect", { x: X0 + 1, y: Y0 + 1, width: BW - 2, height: BH - 2, rx: 3, fill: color,
                           "fill-opacity": b.partial ? 0.45 : 0.8, stroke: b.ok ? "#333" : "#c00",
                           "stroke-width": b.ok ? 1 : 3, "stroke-dasharray": b.partial ? "6 3" : "" }));
      if (b.uneven) g.append(s("rect", { x: X0 + 1, y: Y0 + 1, width: BW - 2, height: BH - 2, fill: "url(#sd-hatch)" }));
      const title = s("title");
      title.textContent = `ranks ${b.ranks.join(", ")}\nlocal ${b.local_shapes.map(shp).join(" / ")}\n` +
        `rows [${b.row0}, ${b.row1}) cols [${b.col0}, ${b.col1})` + (b.uneven ? "\nuneven: smaller than the largest shard" : "");
      g.append(title);
      const cx = X0 + BW / 2, cy = Y0 + BH / 2;
      const who = b.ranks.length > 1 ? `ranks ${b.ranks.join(",")}` : `rank ${b.ranks[0]}`;
      const label = s("text", { x: cx, y: cy - (BH > 34 ? 6 : 0), class: "sd-block-label", "text-anchor": "middle", text: who + (b.partial ? " Σ partial" : "") });
      g.append(label);
      if (BH > 34) {
        const sizes = [];
        if (rd !== null) sizes.push(b.row1 - b.row0);
        if (cd !== null) sizes.push(b.col1 - b.col0);
        g.append(s("text", { x: cx, y: cy + 10, class: "sd-block-shape", "text-anchor": "middle",
                             text: shp(b.local_shapes[0]) + (b.uneven ? "  ▼ uneven" : "") }));
      }
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
  const t = h("table", { class: "sd-table" });
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
      else if (v === null || v === undefined) v = "—";
      tr.append(h("td", { text: String(v), class: "sd-col-" + k }));
    }
    tb.append(tr);
  }
  t.append(tb);
  return t;
}

export function renderInspector(model, el) {
  const root = h("div", { class: "sd-root sd-inspector" });
  el.append(root);
  const draw = () => {
    const data = model.get("data");
    root.replaceChildren();
    if (!data || !data.pairs) return;
    const mesh = data.mesh ? data.mesh.dim_names.map((n, i) => `${n}=${data.mesh.shape[i]}`).join(" × ") : "none";
    root.append(h("div", { class: "sd-title" },
      h("span", { class: "sd-kind", text: data.kind }), " ",
      h("code", { class: "sd-name", text: data.name }), " ",
      h("span", { class: "sd-meta", text: `global ${shp(data.global_shape)} · ${data.dtype} · mesh ${mesh} · ` +
        `placements ${data.placements.length ? data.placements.join(", ") : "—"} · ${data.ranks.length} ranks · ${data.total_bytes_text} in all` })));
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
      h("span", { class: "sd-key sd-key-hatch" }), " uneven (smaller than the largest shard)   ",
      h("span", { class: "sd-key sd-key-bad" }), " spec disagrees with the local tensor   ",
      h("span", { class: "sd-key sd-key-partial" }), " partial (sum over ranks)");
    root.append(legend);
    root.append(table(data));
    if (data.warnings.length) {
      const w = h("div", { class: "sd-warnings" });
      for (const m of data.warnings) w.append(h("div", { class: "sd-warning", text: "⚠ " + m }));
      root.append(w);
    }
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
