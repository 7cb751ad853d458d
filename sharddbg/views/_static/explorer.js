// sharddbg trace explorer: model.get("data") is explorer_data(trace). Filtering and the detail panel run
// here, without the kernel. Every string from the trace is set with textContent (shown as text, never HTML).
function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}
const shp = (a) => (a == null ? "—" : "(" + a.join(", ") + (a.length === 1 ? "," : "") + ")");
// a list of shapes: each shape one unbreakable piece, so a narrow column wraps between shapes, never inside one
const shapeCell = (l) => {
  const td = h("td");
  if (l == null || !l.length) { td.textContent = "—"; return td; }
  l.forEach((a, i) => { if (i) td.append(", "); td.append(h("span", { class: "sd-shape", text: shp(a) })); });
  return td;
};
const ms = (v) => (v == null ? "—" : v.toFixed(3));
const bytes = (n) => {
  if (n == null) return "—";
  const u = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < 3) { n /= 1024; i++; }
  return i ? n.toFixed(1) + " " + u[i] : n + " B";
};
const LIMIT = 400;

export function renderExplorer(model, el) {
  const data = model.get("data");
  // rows are compact: repeated strings (and lists, as JSON text) are indexes into data.strings
  const coded = new Set(data.coded || []), asJson = new Set(data.json_coded || []), S = data.strings || [];
  const parsed = new Map();
  const fromJson = (k) => { if (!parsed.has(k)) parsed.set(k, JSON.parse(S[k])); return parsed.get(k); };
  const val = (f, v) => (v == null ? v : coded.has(f) ? S[v] : asJson.has(f) ? fromJson(v) : v);
  const rows = data.rows.map((r) => Object.fromEntries(data.fields.map((f, i) => [f, val(f, r[i])])));
  const colls = data.collectives.map((r) => Object.fromEntries(data.coll_fields.map((f, i) => [f, r[i]])));
  const root = h("div", { class: "sd-root sd-explorer" });
  el.append(root);
  const c = data.counts;
  const facts = [`${data.total} op calls on ${data.ranks.length} ranks`, `${c.error} error${c.error === 1 ? "" : "s"}`,
                 `${c.fallback} DTensor fallback${c.fallback === 1 ? "" : "s"}`];
  if (data.dropped) facts.push(`${data.dropped} events dropped (buffer full)`);
  if (data.incomplete_ranks.length) facts.push(`incomplete ranks ${data.incomplete_ranks.join(", ")}`);
  root.append(h("div", { class: "sd-title" }, h("span", { class: "sd-kind", text: "Trace explorer" }), " ",
                h("span", { class: "sd-meta", text: facts.join(" · ") })));
  const sel = (label, cls, options) => {
    const s = h("select", { class: cls, "aria-label": label });
    for (const [v, t] of options) s.append(h("option", { value: v, text: t }));
    return [h("label", { class: "sd-control" }, label + " ", s), s];
  };
  const [lRank, fRank] = sel("rank", "sd-f-rank", [["", "all"], ...data.ranks.map((r) => [String(r), String(r)])]);
  const [lPath, fPath] = sel("path", "sd-f-path", [["", "all"], ["@fallback", "any DTensor fallback"], ...data.paths.map((p) => [p, p])]);
  const [lPhase, fPhase] = sel("phase", "sd-f-phase", [["", "all"], ...data.phases.map((p) => [p, p])]);
  const fOp = h("input", { class: "sd-f-op", type: "search", placeholder: "op name contains…", "aria-label": "op" });
  const fFlag = h("input", { class: "sd-f-flagged", type: "checkbox" });
  root.append(h("div", { class: "sd-filters" }, lRank, h("label", { class: "sd-control" }, "op ", fOp), lPath, lPhase,
                h("label", { class: "sd-control" }, fFlag, " errors & fallbacks only")));
  const summary = h("div", { class: "sd-summary" });
  const list = h("div", { class: "sd-list" });
  const detail = h("div", { class: "sd-detail", style: "display:none" });
  root.append(summary, list, detail);
  if (data.left_out) root.insertBefore(h("div", { class: "sd-warning", text: `${data.left_out} ordinary op calls left out (max_rows); errors and fallbacks are all here` }), summary);

  const pill = (p) => h("span", { class: "sd-path", style: `background:${data.path_colors[p] || "#777"}`, text: p });
  // an op call that raised: marked as an error first, its dispatch path after
  const chips = (r) => r.kind === "error" ? h("span", { class: "sd-chips" }, h("span", { class: "sd-chip-error", text: "✖ raised" }), " ", pill(r.path))
                                          : pill(r.path);
  let selected = null;  // [rank, seq] of the op whose detail is open

  function closeDetail() {
    selected = null;
    detail.replaceChildren(); detail.style.display = "none";
    model.set("selected", []); model.save_changes && model.save_changes();
  }

  function showDetail(r, tr) {
    for (const old of list.querySelectorAll("tr.sd-selected")) old.classList.remove("sd-selected");
    if (tr) tr.classList.add("sd-selected");
    selected = [r.rank, r.seq];
    model.set("selected", [r.rank, r.seq]); model.save_changes && model.save_changes();
    const same = rows.filter((x) => x.key === r.key).sort((a, b) => a.rank - b.rank);
    detail.replaceChildren();
    detail.style.display = "";
    detail.setAttribute("data-rank", r.rank); detail.setAttribute("data-seq", r.seq);
    detail.append(h("h4", {}, h("span", { class: "sd-detail-op", text: r.op }), " ", chips(r),
                    h("span", { class: "sd-meta", text: ` ${r.phase} · rank ${r.rank} · seq ${r.seq}` })));
    const kv = h("div", { class: "sd-kv" });
    const add = (k, v) => { if (v != null && v !== "") kv.append(h("div", { text: k }), h("div", { text: String(v), class: "sd-kv-" + k.replace(/\W+/g, "-") })); };
    add("handler", r.handler); add("module", r.module); add("user source line", r.user_frame);
    add("autograd node", r.autograd_node); add("forward seq", r.fwd_seq); add("parent seq", r.parent_seq);
    add("placements", r.placements); add("dtype", r.dtype);
    if (r.kind === "fallback") add("note", "this call ran through the DTensor fallback (no ShardTensor handler took it)");
    if (r.in_flight) add("state", "still running when the trace was taken (the rank timed out or hung here)");
    if (r.not_implemented) add("returned", "NotImplemented");
    detail.append(kv);
    if (r.exc_type) {
      detail.append(h("div", { class: "sd-error-msg", text: `${r.exc_type}: ${r.error && r.error.includes(": ") ? r.error.slice(r.error.indexOf(": ") + 2) : r.error}` }));
      if (r.unmasked) detail.append(h("div", { class: "sd-meta", text: "PyTorch would have shown the generic \"unsupported operand type(s)\" TypeError here; sharddbg re-raised this cause." }));
      if (r.traceback) detail.append(h("pre", { class: "sd-tb", text: r.traceback }));
    }
    detail.append(h("h4", { text: `the same call on every rank (${same.length})` }));
    const t = h("table", { class: "sd-table sd-per-rank" });
    const cols = [["rank", "rank"], ["seq", "seq"], ["path", "path"], ["in_local_shapes", "inputs (local)"],
                  ["in_global_shapes", "inputs (global)"], ["out_local_shape", "output (local)"],
                  ["out_global_shape", "output (global)"], ["placements", "placements"], ["host_ms", "host ms"],
                  ["in_bytes", "bytes in"], ["out_bytes", "bytes out"], ["error", "error"]];
    t.append(h("thead", {}, h("tr", {}, ...cols.map(([, l]) => h("th", { text: l })))));
    const tb = h("tbody");
    for (const x of same) {
      const tr = h("tr", { "data-rank": x.rank, class: x.kind === "error" ? "sd-kind-error" : "" });
      for (const [k] of cols) {
        let v = x[k];
        if (k === "in_local_shapes" || k === "in_global_shapes" || k === "out_local_shape" || k === "out_global_shape") {
          const td = shapeCell(k.startsWith("in_") ? v : v == null ? null : [v]);
          td.className = "sd-col-" + k; tr.append(td); continue;
        }
        else if (k === "host_ms") v = ms(v);
        else if (k === "in_bytes" || k === "out_bytes") v = bytes(v);
        else if (v == null) v = "—";
        tr.append(h("td", { text: String(v), class: "sd-col-" + k }));
      }
      tb.append(tr);
    }
    t.append(tb); detail.append(t);
    const pairs = new Set(same.map((x) => x.rank + ":" + x.seq));
    const mine = colls.filter((k) => pairs.has(k.rank + ":" + k.op_seq) || pairs.has(k.rank + ":" + k.outer_op_seq));
    detail.append(h("h4", { text: "collectives" }));
    if (!data.has_collectives) detail.append(h("div", { class: "sd-meta", text: "this trace does not record collectives" }));
    else if (!mine.length) detail.append(h("div", { class: "sd-meta", text: "no collectives recorded for this call" }));
    else {
      const ct = h("table", { class: "sd-table sd-collectives" });
      const cc = [["rank", "rank"], ["phase", "phase"], ["kind", "kind"], ["group_ranks", "group"], ["mesh_dim", "mesh dim"],
                  ["bytes_sent", "sent"], ["bytes_recv", "received"], ["duration_ms", "ms"], ["param", "param"]];
      ct.append(h("thead", {}, h("tr", {}, ...cc.map(([, l]) => h("th", { text: l })))));
      const cb = h("tbody");
      for (const k of mine.sort((a, b) => (a.phase > b.phase ? -1 : a.phase < b.phase ? 1 : 0) || a.rank - b.rank || a.seq - b.seq)) {
        cb.append(h("tr", {}, ...cc.map(([f]) => h("td", { text: f.startsWith("bytes") ? bytes(k[f]) : f === "duration_ms" ? ms(k[f]) : Array.isArray(k[f]) ? k[f].join(",") : String(k[f] ?? "—") }))));
      }
      ct.append(cb); detail.append(ct);
    }
  }

  function draw() {
    const rank = fRank.value, path = fPath.value, phase = fPhase.value, op = fOp.value.trim().toLowerCase(), flagged = fFlag.checked;
    const hit = rows.filter((r) => (rank === "" || String(r.rank) === rank) &&
      (path === "" || (path === "@fallback" ? r.kind === "fallback" : r.path === path)) &&
      (phase === "" || r.phase === phase) && (!op || r.op.toLowerCase().includes(op)) && (!flagged || r.kind !== "op"));
    summary.textContent = `${hit.length} matching` + (hit.length > LIMIT ? ` (first ${LIMIT} shown; refine the filters)` : "") + " · click a row for its detail";
    const t = h("table", { class: "sd-table sd-op-list" });
    // short columns have fixed widths, the others share the rest of the box equally: the table never grows
    // wider than its box; a long cell ends in "…" (its full text on hover)
    const cols = data.list_columns;
    t.append(h("colgroup", {}, ...cols.map(([, , w]) => h("col", w ? { style: `width:${w}px` } : {}))));
    t.append(h("thead", {}, h("tr", {}, ...cols.map(([, l]) => h("th", { text: l })))));
    const tb = h("tbody");
    const shown = hit.slice(0, LIMIT);
    for (const r of shown) {
      const isSel = selected && r.rank === selected[0] && r.seq === selected[1];
      const tr = h("tr", { class: `sd-op sd-kind-${r.kind}` + (isSel ? " sd-selected" : ""), "data-rank": r.rank,
                           "data-seq": r.seq, "data-kind": r.kind, "data-op": r.op });
      for (const [k] of cols) {
        if (k === "path") { tr.append(h("td", { class: "sd-col-path", title: r.path }, chips(r))); continue; }
        let v = r[k], full = null;
        if (k === "kind") v = r.kind === "error" ? "✖ error" : r.kind === "fallback" ? "⚠ fallback" : r.in_flight ? "⏳ running" : "";
        else if (k === "out_local_shape") v = shp(v);
        else if (k === "host_ms") v = ms(v);
        else if (k === "user_frame" && v) { full = v; v = v.split("/").pop(); }
        else if (v == null) v = "";
        const td = h("td", { text: String(v), class: "sd-col-" + (k === "kind" ? "flag" : k) });
        if (String(full ?? v)) td.title = String(full ?? v);
        tr.append(td);
      }
      tr.addEventListener("click", () => showDetail(r, tr));
      tb.append(tr);
    }
    t.append(tb);
    list.replaceChildren(t);
    // a detail whose row the filters took away closes with it
    if (selected && !shown.some((r) => r.rank === selected[0] && r.seq === selected[1])) closeDetail();
  }
  for (const f of [fRank, fPath, fPhase, fFlag]) f.addEventListener("change", draw);
  fOp.addEventListener("input", draw);
  draw();
}

export default { render({ model, el }) { renderExplorer(model, el); } };
