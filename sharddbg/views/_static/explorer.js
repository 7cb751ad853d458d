// sharddbg trace explorer: model.get("data") is explorer_data(trace). It opens on the op summary (one row per
// op, path and phase; a click expands the row to its calls on each rank, identical ones as one row "ranks
// 0-3"); "every call" shows the list of calls. Filtering, expanding and the detail panel run here, without
// the kernel. Every string from the trace is set with textContent (shown as text, never HTML).
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
// one time, or the range of a group's times
const msRange = (lo, hi) => (lo == null || ms(lo) === ms(hi) ? ms(lo) : `${ms(lo)}–${ms(hi)}`);
const shapes = (l) => (l == null || !l.length ? "—" : l.map(shp).join(", "));
const bytes = (n) => {
  if (n == null) return "—";
  const u = ["B", "KiB", "MiB", "GiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < 3) { n /= 1024; i++; }
  return i ? n.toFixed(1) + " " + u[i] : n + " B";
};

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
  // The header and the findings come from the trace's own overview and findings (sharddbg.analysis.findings):
  // shown as they are, in their order. A widget saved by an older sharddbg has no headline, and findings as text.
  const c = data.counts;
  const headline = data.headline || `${data.total} op calls on ${data.ranks.length} ranks, ${c.error} raised, ` +
                   `${c.fallback} through a DTensor fallback`;
  root.append(h("div", { class: "sd-title" }, h("span", { class: "sd-kind", text: "Trace explorer" }), " ",
                h("span", { class: "sd-meta", text: headline })));
  if (data.findings && data.findings.length) {
    const marks = data.severity_marks || {};
    const titles = data.category_titles || {};
    const box = h("div", { class: "sd-findings" });
    // each finding: its mark, its category, its first clause; the rest and the fix behind a click
    // (a finding saved by an older sharddbg has no summary: its whole text, on one line)
    for (const f of data.findings) {
      const found = typeof f === "string" ? { severity: "warn", text: f } : f;
      const cls = `sd-finding sd-finding-${found.severity}` + (found.category ? ` sd-category-${found.category}` : "");
      const head = [`${marks[found.severity] || "⚠"} `];
      if (found.category) head.push(h("span", { class: "sd-finding-category", text: titles[found.category] || found.category }), " ");
      head.push(found.summary || found.text);
      if (found.details) {
        box.append(h("details", { class: cls }, h("summary", {}, ...head),
                     h("div", { class: "sd-finding-details", text: found.details })));
      } else {
        box.append(h("div", { class: cls }, ...head));
      }
    }
    root.append(box);
  }
  const sel = (label, cls, options) => {
    const s = h("select", { class: cls, "aria-label": label });
    for (const [v, t] of options) s.append(h("option", { value: v, text: t }));
    return [h("label", { class: "sd-control" }, label + " ", s), s];
  };
  // the op summary, unless the data has none (a widget saved by an older sharddbg): then the list of calls
  const summaryRows = Array.isArray(data.summary) ? data.summary : null;
  const [lView, fView] = summaryRows
    ? sel("show", "sd-f-view", [["summary", `op summary (${summaryRows.length} rows)`], ["calls", `every call (${data.total})`]])
    : [null, null];
  const [lRank, fRank] = sel("rank", "sd-f-rank", [["", "all"], ...data.ranks.map((r) => [String(r), String(r)])]);
  const [lPath, fPath] = sel("path", "sd-f-path", [["", "all"], ["@fallback", "any DTensor fallback"], ...data.paths.map((p) => [p, p])]);
  const [lPhase, fPhase] = sel("phase", "sd-f-phase", [["", "all"], ...data.phases.map((p) => [p, p])]);
  if (data.initial_rank != null) fRank.value = String(data.initial_rank);  // t.show(rank=...)
  const fOp = h("input", { class: "sd-f-op", type: "search", placeholder: "op name contains…", "aria-label": "op" });
  const fFlag = h("input", { class: "sd-f-flagged", type: "checkbox" });
  root.append(h("div", { class: "sd-filters" }, lView, lRank, h("label", { class: "sd-control" }, "op ", fOp), lPath, lPhase,
                h("label", { class: "sd-control" }, fFlag, " errors & fallbacks only")));
  const status = h("div", { class: "sd-status" });
  const list = h("div", { class: "sd-list" });
  const detail = h("div", { class: "sd-detail", style: "display:none" });
  root.append(status, list, detail);
  // a big trace's payload holds a sample of its calls: the page says which, and how to list the others
  if (data.left_out_text) root.insertBefore(h("div", { class: "sd-warning sd-left-out", text: data.left_out_text }), status);
  else if (data.left_out) root.insertBefore(h("div", { class: "sd-warning sd-left-out", text: `${data.left_out} ordinary op calls left out of the list (max_rows); errors and fallbacks are all here, and the op summary counts every call` }), status);

  // an op name that may break after each dot (never inside a name), in full on hover; a backward row is marked
  // "bwd" so it reads apart from the forward row of the same op
  const opName = (op) => {
    const out = h("span", { class: "sd-op-name", title: op });
    op.split(/(?<=\.)/).forEach((part, i) => { if (i) out.append(h("wbr")); out.append(part); });
    return out;
  };
  const phaseChip = (phase) => (phase === "backward"
    ? h("span", { class: "sd-chip-phase", title: "backward: run by autograd for this op's output", text: "bwd" }) : null);
  const opCell = (r, caret) => h("td", { class: "sd-col-op", title: r.op + (r.phase === "backward" ? " (backward)" : "") },
    caret, opName(r.op), phaseChip(r.phase));
  // the widest path chip, measured in the page's UI font (11 px), with the chip's and the cell's padding
  let pathWidth = null;
  const pathPx = () => {
    if (pathWidth == null) {
      const ctx = document.createElement("canvas").getContext("2d");
      const family = getComputedStyle(root).getPropertyValue("--jp-ui-font-family").trim() || "system-ui, sans-serif";
      ctx.font = `11px ${family}`;
      pathWidth = Math.ceil(Math.max(data.flexible_min_px || 0, ...data.paths.map((p) => ctx.measureText(p).width + 10 + 16 + 6)));
    }
    return pathWidth;
  };
  const pill = (p) => h("span", { class: "sd-path", style: `background:${data.path_colors[p] || "#777"}`, text: p });
  // an op call that raised: marked as an error first, its dispatch path after; one whose exception the user's
  // code caught is marked so, without the error's mark
  // a result whose spec disagrees with its local tensor (a call: its text; a summary row: how many calls)
  const specChip = (r) => {
    const text = r.spec_mismatch || (r.spec_mismatches ? `${r.spec_mismatches} call(s) made a result whose spec disagrees with its local tensor` : null);
    return text ? h("span", { class: "sd-chip-spec", title: text, text: "⚠ spec ≠ data" }) : null;
  };
  const chips = (r) => {
    const spec = specChip(r);
    const handled = r.kind !== "error" && r.exc_type;
    if (r.kind !== "error" && !spec && !handled) return pill(r.path);
    const out = h("span", { class: "sd-chips" });
    if (spec) out.append(spec, " ");
    if (r.kind === "error") out.append(h("span", { class: "sd-chip-error", text: "✖ raised" }), " ");
    if (handled) out.append(h("span", { class: "sd-chip-handled", title: "it raised; the user's code caught it and the cell went on", text: "raised, handled" }), " ");
    out.append(pill(r.path));
    return out;
  };
  let selected = null;  // [rank, seq] of the op whose detail is open
  const byCall = new Map(rows.map((r) => [r.rank + ":" + r.seq, r]));
  const expanded = new Set();  // indexes of the summary rows shown with their calls

  function closeDetail() {
    selected = null;
    detail.replaceChildren(); detail.style.display = "none";
    model.set("selected", []); model.save_changes && model.save_changes();
  }

  // the detail of call r (a row of the list); from a row of the summary, ``group`` is that row (r: its first call)
  function showDetail(r, tr, group) {
    for (const old of list.querySelectorAll("tr.sd-selected")) old.classList.remove("sd-selected");
    if (tr) tr.classList.add("sd-selected");
    selected = r ? [r.rank, r.seq] : [group.first_rank, group.first_seq];
    model.set("selected", selected); model.save_changes && model.save_changes();
    if (!r) {  // a call beyond max_rows: the summary covers it, the rows shipped here do not
      detail.replaceChildren(h("div", { class: "sd-meta", text: `rank ${selected[0]}, seq ${selected[1]}: this call is not among the ` +
        `${rows.length} calls shipped to this view` + (data.sample ? "" : " (max_rows)") + `; t.show(rank=${selected[0]}, ` +
        `window=...) lists the calls of a window, t.get_ops() has every call` }));
      detail.style.display = "";
      detail.setAttribute("data-rank", selected[0]); detail.setAttribute("data-seq", selected[1]);
      return;
    }
    const same = rows.filter((x) => x.key === r.key).sort((a, b) => a.rank - b.rank);
    detail.replaceChildren();
    detail.style.display = "";
    detail.setAttribute("data-rank", r.rank); detail.setAttribute("data-seq", r.seq);
    detail.append(h("h4", {}, h("span", { class: "sd-detail-op", text: r.op }), " ", chips(r),
                    h("span", { class: "sd-meta", text: ` ${r.phase} · rank ${r.rank} · seq ${r.seq}` })));
    const kv = h("div", { class: "sd-kv" });
    const add = (k, v) => { if (v != null && v !== "") kv.append(h("div", { text: k }), h("div", { text: String(v), class: "sd-kv-" + k.replace(/\W+/g, "-") })); };
    if (group && group.calls > 1) add("summary row", `${group.ranks_text}: ${group.calls} identical calls, host ${msRange(group.host_ms_min, group.host_ms_max)} ms; this one is the first`);
    add("handler", r.handler); add("module", r.module); add("user source line", r.user_frame);
    add("autograd node", r.autograd_node); add("forward seq", r.fwd_seq); add("parent seq", r.parent_seq);
    add("placements", r.placements); add("dtype", r.dtype);
    if (r.kind === "fallback") {
      add("note", "this call ran through the DTensor fallback (no ShardTensor handler took it)");
      const fam = (data.patch_families || {})[r.op];
      if (fam) {
        add("patch family", fam.family + (fam.halo_width != null ? ` (halo of ${fam.halo_width} row${fam.halo_width > 1 ? "s" : ""})` : ""));
        add("closest patch", fam.closest_patch); add("evidence", fam.evidence);
        add("fallback moved", fam.fallback_collectives);
      }
    }
    if (r.in_flight) add("state", "still running when the trace was taken (the rank timed out or hung here)");
    if (r.spec_mismatch) add("spec mismatch", r.spec_mismatch);
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
    // a column's fourth entry, where it has one, says what it counts and against what (the header's tooltip)
    t.append(h("thead", {}, h("tr", {}, ...cols.map(([, l, , help]) => h("th", help ? { text: l, title: help } : { text: l })))));
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
    // the collectives that count for this call, as the op summary counts them (analysis.comm.collective_calls):
    // those it issued or enclosed; for a backward event, those its forward call's autograd nodes issued
    const backward = r.phase === "backward";
    const pairs = new Set(same.map((x) => x.rank + ":" + (backward ? x.fwd_seq : x.seq)));
    const counted = (k) => (k.counted_seqs || (k.op_seq == null ? [] : [k.op_seq])).some((s) => pairs.has(k.rank + ":" + s));
    const mine = colls.filter((k) => (!backward || k.phase === "backward") && counted(k));
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

  // the filters, as one test for a call (a row of the list) and one for a summary row
  function filters() {
    const rank = fRank.value, path = fPath.value, phase = fPhase.value, op = fOp.value.trim().toLowerCase(), flagged = fFlag.checked;
    const common = (r) => (path === "" || (path === "@fallback" ? r.kind === "fallback" : r.path === path)) &&
      (phase === "" || r.phase === phase) && (!op || r.op.toLowerCase().includes(op)) && (!flagged || r.kind !== "op");
    return {
      call: (r) => (rank === "" || String(r.rank) === rank) && common(r),
      summary: (s) => (rank === "" || s.ranks.includes(Number(rank))) && common(s),
      group: (g) => rank === "" || g.ranks.includes(Number(rank)),
    };
  }

  function table(cls, cols) {
    const t = h("table", { class: "sd-table " + cls });
    // short columns have fixed widths, the others share the rest of the box equally: the table never grows
    // wider than its box; a long cell ends in "…" (its full text on hover)
    // ... but a flexible column never gets less than flexible_min_px, and the path column holds its widest chip:
    // a narrow box scrolls sideways instead
    const least = data.flexible_min_px || 0;
    const width = (f, w) => w || (least && f === "path" ? pathPx() : null);
    t.append(h("colgroup", {}, ...cols.map(([f, , w]) => h("col", width(f, w) ? { style: `width:${width(f, w)}px` } : {}))));
    if (least) t.style.minWidth = cols.reduce((a, [f, , w]) => a + (width(f, w) || least), 0) + "px";
    // a column's fourth entry, where it has one, says what it counts and against what (the header's tooltip)
    t.append(h("thead", {}, h("tr", {}, ...cols.map(([, l, , help]) => h("th", help ? { text: l, title: help } : { text: l })))));
    return t;
  }

  const cell = (k, text, full) => {
    const td = h("td", { text: String(text), class: "sd-col-" + k });
    if (String(full ?? text)) td.title = String(full ?? text);
    return td;
  };
  const flagText = (r) => (r.kind === "error" ? "✖ error" : r.kind === "fallback" ? "⚠ fallback" : r.in_flight ? "⏳ running" : "");

  // The list is virtual: only the rows in and near the list's box are in the page (a window of items, each a row
  // or a summary row with its expansion), between two spacers as tall as the rows above and below, so any number
  // of calls scrolls and redraws in the same time. Heights start from an estimate and are measured once drawn.
  const OVERSCAN = 20;  // items drawn beyond each edge of the box
  const WHOLE = 200;  // a list of at most this many items is drawn whole (the page's find sees every row)
  let rowEstimate = 25;  // px; the mean height of the rows drawn so far
  let view = null;  // { table, body, items, render, heights, prefix, first, last, drawn: Map(index -> rows) }

  function spacer(cols) {
    const td = h("td", { colspan: cols, class: "sd-spacer" });
    return [h("tr", { class: "sd-spacer-row", "aria-hidden": "true" }, td), td];
  }

  // items drawn in ``t`` by ``render(item, index)`` (which returns the item's rows); the list keeps its scroll
  // position (clamped to the new content)
  function mount(t, items, render, estimate) {
    const body = h("tbody");
    const ncols = t.querySelectorAll(":scope > colgroup > col").length || 1;
    const [topRow, topTd] = spacer(ncols), [bottomRow, bottomTd] = spacer(ncols);
    const heights = new Float64Array(items.length);
    items.forEach((item, i) => { heights[i] = estimate ? estimate(item) : rowEstimate; });
    t.append(body);
    const keep = list.scrollTop;
    list.replaceChildren(t);
    view = { table: t, body, items, render, heights, prefix: null, first: -1, last: -1, drawn: new Map(),
             topRow, topTd, bottomRow, bottomTd };
    layoutWindow(true, keep);
  }

  function prefixSums(v) {
    if (!v.prefix) {
      v.prefix = new Float64Array(v.items.length + 1);
      for (let i = 0; i < v.items.length; i++) v.prefix[i + 1] = v.prefix[i] + v.heights[i];
    }
    return v.prefix;
  }
  // the item at ``y`` px below the top of the body
  function itemAt(v, y) {
    const pre = prefixSums(v);
    let lo = 0, hi = v.items.length - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (pre[mid] <= y) lo = mid; else hi = mid - 1; }
    return Math.max(0, lo);
  }
  const headHeight = (v) => (v.table.tHead ? v.table.tHead.offsetHeight : 0);

  // draw the items in and near the box (again only when the box moved near the edge of those drawn, or ``force``);
  // ``scrollTop``: where the list is to be scrolled (its content just replaced); ``around``: an item to draw
  // whatever the scroll position (a list not on the page yet)
  function layoutWindow(force, scrollTop, around) {
    const v = view;
    if (!v) return;
    const n = v.items.length;
    const boxH = list.clientHeight || 400;  // a list not yet on the page: as tall as its CSS allows at most
    const top = Math.max(0, (scrollTop ?? list.scrollTop) - headHeight(v));
    let vf = n ? itemAt(v, top) : 0, vl = n ? itemAt(v, top + boxH) : -1;
    if (around != null && n) { vf = around; vl = Math.min(n - 1, around + 15); }
    if (n <= WHOLE) { vf = 0; vl = n - 1; }
    if (!force && vf >= v.first && vl <= v.last && (vf - v.first >= OVERSCAN / 3 || v.first === 0) &&
        (v.last - vl >= OVERSCAN / 3 || v.last === n - 1)) return;
    const first = Math.max(0, vf - OVERSCAN), last = Math.min(n - 1, vl + OVERSCAN);
    // a list scrolled to its end stays there whatever the measured heights (its last call in the box)
    const atEnd = scrollTop == null && list.scrollTop > 0 && list.scrollTop + list.clientHeight >= list.scrollHeight - 2;
    const drawn = new Map(), out = [];
    for (let i = first; i <= last; i++) {
      const rowsOf = (!force && v.drawn.get(i)) || v.render(v.items[i], i);
      drawn.set(i, rowsOf);
      out.push(...rowsOf);
    }
    v.first = first; v.last = last; v.drawn = drawn;
    v.body.replaceChildren(v.topRow, ...out, v.bottomRow);
    setSpacers(v);
    if (scrollTop != null) list.scrollTop = scrollTop;
    // measured heights replace the estimates; the item at the top of the box stays where it was
    if (!list.clientHeight || !n) return;
    const anchor = vf, anchorY = prefixSums(v)[anchor] - top;
    let changed = false, sum = 0, count = 0;
    for (const [i, rs] of drawn) {
      let hh = 0;
      for (const r of rs) hh += r.getBoundingClientRect().height;
      if (!hh) continue;
      if (rs.length === 1) { sum += hh; count++; }
      if (Math.abs(hh - v.heights[i]) > 0.5) { v.heights[i] = hh; changed = true; }
    }
    if (count) rowEstimate = sum / count;
    if (changed) {
      v.prefix = null;
      setSpacers(v);
      const want = prefixSums(v)[anchor] - anchorY + headHeight(v);
      if (Math.abs(list.scrollTop - want) > 1 && list.scrollTop > 0) list.scrollTop = want;
    }
    if (atEnd) list.scrollTop = list.scrollHeight;
  }
  function setSpacers(v) {
    const pre = prefixSums(v), n = v.items.length;
    const above = v.first > 0 ? pre[v.first] : 0, below = v.last >= 0 ? pre[n] - pre[v.last + 1] : 0;
    v.topTd.style.height = above + "px"; v.topRow.style.display = above ? "" : "none";
    v.bottomTd.style.height = below + "px"; v.bottomRow.style.display = below ? "" : "none";
  }
  // item ``i`` drawn and within the list's box; returns its rows
  function reveal(i) {
    const v = view;
    if (!v || i < 0 || i >= v.items.length) return null;
    const boxH = list.clientHeight;
    if (boxH) {
      const pre = prefixSums(v), head = headHeight(v), y = pre[i] + head, bottom = pre[i + 1] + head;
      if (y < list.scrollTop) list.scrollTop = y;
      else if (bottom > list.scrollTop + boxH) list.scrollTop = bottom - boxH;
      layoutWindow(false);
    }
    if (!v.drawn.has(i)) layoutWindow(true, null, i);
    return v.drawn.get(i) || null;
  }
  list.addEventListener("scroll", () => {
    if (view && !view.pending) {
      view.pending = true;
      const v = view;
      requestAnimationFrame(() => { v.pending = false; if (v === view) layoutWindow(false); });
    }
  }, { passive: true });
  // a list drawn before it was on the page (a notebook's output) is drawn again once it has its size
  if (typeof ResizeObserver !== "undefined") {
    let lastH = 0;
    new ResizeObserver(() => { if (list.clientHeight !== lastH) { lastH = list.clientHeight; layoutWindow(true); fitPaths(); } }).observe(list);
  }

  function callRow(r, cols) {
    const isSel = selected && r.rank === selected[0] && r.seq === selected[1];
    const tr = h("tr", { class: `sd-op sd-kind-${r.kind} sd-phase-${r.phase}` + (isSel ? " sd-selected" : ""), "data-rank": r.rank,
                         "data-seq": r.seq, "data-kind": r.kind, "data-op": r.op });
    for (const [k] of cols) {
      if (k === "path") { tr.append(h("td", { class: "sd-col-path", title: r.path }, chips(r))); continue; }
      if (k === "op") { tr.append(opCell(r, null)); continue; }
      let v = r[k], full = null;
      if (k === "kind") { tr.append(cell("flag", flagText(r))); continue; }
      else if (k === "out_local_shape") v = shp(v);
      else if (k === "host_ms") v = ms(v);
      else if (k === "user_frame" && v) { full = v; v = v.split("/").pop(); }
      else if (v == null) v = "";
      tr.append(cell(k, v, full));
    }
    tr.addEventListener("click", () => showDetail(r, tr));
    return tr;
  }

  function drawCalls(f) {
    const hit = rows.filter(f.call);
    status.textContent = `${hit.length} matching calls · click a row for its detail (↑ ↓ in the list: the next call)`;
    const cols = data.list_columns;
    mount(table("sd-op-list", cols), hit, (r) => [callRow(r, cols)]);
    return !!selected && hit.some((r) => r.rank === selected[0] && r.seq === selected[1]);
  }

  // the rows a summary row expands to: its calls on each rank, identical ones as one row ("ranks 0-3")
  function groupTable(s, f, sel) {
    const cols = data.group_columns;
    const t = table("sd-call-groups", cols);
    const tb = h("tbody");
    for (const g of s.groups) {
      if (!f.group(g)) continue;
      const r = byCall.get(g.first_rank + ":" + g.first_seq);
      const isSel = sel != null ? sel.call_group === g.call_group
        : !!selected && !byCall.has(selected[0] + ":" + selected[1]) && g.first_rank === selected[0] && g.first_seq === selected[1];
      const tr = h("tr", { class: `sd-op sd-call-group sd-kind-${g.kind}` + (isSel ? " sd-selected" : ""), "data-rank": g.first_rank,
                           "data-seq": g.first_seq, "data-kind": g.kind, "data-op": s.op, "data-ranks": g.ranks.join(",") });
      for (const [k] of cols) {
        if (k === "kind") tr.append(g.spec_mismatch && g.kind === "op" ? h("td", { class: "sd-col-flag" }, specChip(g)) : cell("flag", flagText(g)));
        else if (k === "in_local_shapes") tr.append(cell(k, shapes(g[k])));
        else if (k === "out_local_shape") tr.append(cell(k, shp(g[k])));
        else if (k === "host_ms") tr.append(cell(k, msRange(g.host_ms_min, g.host_ms_max)));
        else tr.append(cell(k, g[k] ?? ""));
      }
      tr.addEventListener("click", (e) => { e.stopPropagation(); showDetail(r, tr, g); });
      tb.append(tr);
    }
    if (s.more_groups) tb.append(h("tr", { class: "sd-more-groups" }, h("td", { colspan: cols.length, class: "sd-meta",
      text: `… ${s.more_groups} more groups of different calls, left out of this view: t.show(rank=..., window=...) lists them` })));
    t.append(tb);
    return t;
  }

  function summaryRow(s, i, cols, f) {
    const open = expanded.has(i);
    const tr = h("tr", { class: `sd-summary-row sd-kind-${s.kind} sd-phase-${s.phase}` + (open ? " sd-expanded" : "") +
                         (cursor === i ? " sd-cursor" : ""), "data-index": i,
                         "data-op": s.op, "data-path": s.path, "data-phase": s.phase, "data-kind": s.kind });
    for (const [k] of cols) {
      if (k === "kind") {
        const td = cell("flag", flagText(s));
        td.title = s.kind === "error" ? `${s.errors} of ${s.calls} calls raised` : s.kind === "fallback" ? "ran through a DTensor fallback" : "";
        tr.append(td);
      } else if (k === "op") {
        tr.append(opCell(s, h("span", { class: "sd-caret", text: open ? "▾" : "▸" })));
      } else if (k === "path") tr.append(h("td", { class: "sd-col-path", title: s.path }, chips(s)));
      else if (k === "ranks") tr.append(cell(k, s.ranks_text.replace(/^ranks? /, ""), s.ranks_text));
      else if (k === "dispatch_bound") {
        const td = cell(k, s.dispatch_bound ? "bound" : "", "");
        if (s.dispatch_bound) td.title = `host dispatch adds ${ms(s.dispatch_ms_median)} ms per call (median), more than the local computation (${ms(s.local_ms_median)} ms)`;
        tr.append(td);
      } else if (k === "locations") tr.append(cell(k, (s.locations || [])[0] || "", (s.locations || []).join("\n")));
      else if (k.includes("_ms")) tr.append(cell(k, ms(s[k])));
      else tr.append(cell(k, s[k] ?? ""));
    }
    tr.addEventListener("click", () => { cursor = i; toggle(i); });
    if (!open) return [tr];
    const selRow = selected ? byCall.get(selected[0] + ":" + selected[1]) : null;
    const gt = groupTable(s, f, selRow && selRow.summary_row === i ? selRow : null);
    return [tr, h("tr", { class: "sd-expansion", "data-index": i }, h("td", { colspan: cols.length }, gt))];
  }
  function toggle(i) { if (expanded.has(i)) expanded.delete(i); else expanded.add(i); draw(); }

  function drawSummary(f) {
    const hit = summaryRows.map((s, i) => [s, i]).filter(([s]) => f.summary(s));
    status.textContent = `${hit.length} of ${summaryRows.length} rows (op · path · phase)` +
      " · click a row for its calls on each rank (↑ ↓ and Enter in the list)";
    const cols = data.summary_columns;
    // an expanded row: its row, its groups' header and its groups (those the filters keep)
    const estimate = ([s, i]) => (expanded.has(i) ? rowEstimate * (2 + s.groups.filter(f.group).length + (s.more_groups ? 1 : 0)) : rowEstimate);
    mount(table("sd-op-list sd-op-summary", cols), hit, ([s, i]) => summaryRow(s, i, cols, f), estimate);
    // the open detail's call is shown when its group is: in an expanded row the filters keep
    if (!selected) return false;
    const selRow = byCall.get(selected[0] + ":" + selected[1]);
    return hit.some(([s, i]) => expanded.has(i) && s.groups.some((g) => f.group(g) &&
      (selRow ? selRow.summary_row === i && g.call_group === selRow.call_group : g.first_rank === selected[0] && g.first_seq === selected[1])));
  }

  // the path column as wide as its widest chip drawn (the page's font can differ from the measure above);
  // once the view is on the page, so again on the next frame
  function fitPaths() {
    const t = list.querySelector("table.sd-op-list");
    const chips = list.querySelectorAll("table.sd-op-list > tbody > tr > td.sd-col-path .sd-path");
    if (!t || !chips.length || !chips[0].offsetWidth) return;
    const need = Math.ceil(Math.max(...[...chips].map((c) => c.offsetWidth))) + 16;
    if (need <= pathPx()) return;
    const extra = need - pathPx();
    pathWidth = need;
    const cols = [...t.querySelectorAll(":scope > colgroup > col")];
    const k = (fView && fView.value === "summary" ? data.summary_columns : data.list_columns).findIndex(([f]) => f === "path");
    if (k >= 0 && cols[k]) cols[k].style.width = need + "px";
    if (t.style.minWidth) t.style.minWidth = (parseFloat(t.style.minWidth) + extra) + "px";
  }

  let cursor = null;  // the summary row the keys move over (its index in the summary)
  function draw() {
    const f = filters();
    const shownSel = fView && fView.value === "summary" ? drawSummary(f) : drawCalls(f);
    fitPaths();
    requestAnimationFrame(fitPaths);
    // a detail whose row the filters (or a collapsed summary row) took away closes with it
    if (selected && !shownSel) closeDetail();
  }
  if (fView) fView.addEventListener("change", () => {
    // the summary row holding the open detail opens with the summary
    const r = selected && byCall.get(selected[0] + ":" + selected[1]);
    if (fView.value === "summary" && r && r.summary_row != null) expanded.add(r.summary_row);
    draw();
  });
  for (const f of [fRank, fPath, fPhase, fFlag]) f.addEventListener("change", draw);
  fOp.addEventListener("input", draw);

  // the keyboard, in the list (it takes the focus on a click, or by Tab): ↑ ↓ move to the previous or next
  // call (its detail opened) or summary row, Enter or Space opens or closes a summary row, Escape closes the
  // detail; Page Up / Down, Home and End scroll the list as usual. A key the list takes goes no further (in
  // JupyterLab, ↑ ↓ and Enter would otherwise also move between cells or edit one)
  list.tabIndex = 0;
  list.setAttribute("aria-label", "op calls; arrow keys move between rows");
  list.addEventListener("keydown", (e) => {
    if (!view || e.altKey || e.ctrlKey || e.metaKey) return;
    const summary = fView && fView.value === "summary";
    const items = view.items;
    if (e.key === "ArrowDown" || e.key === "ArrowUp") {
      const step = e.key === "ArrowDown" ? 1 : -1;
      let at;
      if (summary) at = items.findIndex(([, i]) => i === cursor);
      else at = selected ? items.findIndex((r) => r.rank === selected[0] && r.seq === selected[1]) : -1;
      const next = at < 0 ? (step > 0 ? 0 : items.length - 1) : Math.min(items.length - 1, Math.max(0, at + step));
      if (!items.length) return;
      e.preventDefault(); e.stopPropagation();
      if (summary) {
        cursor = items[next][1];
        for (const old of list.querySelectorAll("tr.sd-cursor")) old.classList.remove("sd-cursor");
        const rs = reveal(next);
        if (rs) rs[0].classList.add("sd-cursor");
      } else {
        const rs = reveal(next);
        showDetail(items[next], rs ? rs[0] : null);
      }
    } else if ((e.key === "Enter" || e.key === " ") && summary && cursor != null) {
      e.preventDefault(); e.stopPropagation();
      toggle(cursor);
    } else if (e.key === "Escape" && selected) {
      e.preventDefault(); e.stopPropagation();
      for (const old of list.querySelectorAll("tr.sd-selected")) old.classList.remove("sd-selected");
      closeDetail();
    }
  });

  draw();
  // opened on a call (``TraceExplorer(trace, selected=[rank, seq])``: the op a diff found departing): its summary
  // row expanded, its row selected and in view, its detail shown
  const initial = model.get("selected") || [];
  const opened = initial.length === 2 ? byCall.get(initial[0] + ":" + initial[1]) : null;
  if (opened) {
    if (fView && fView.value === "summary" && opened.summary_row != null) { expanded.add(opened.summary_row); draw(); }
    const index = () => view.items.findIndex((x) => (Array.isArray(x) ? x[1] === opened.summary_row : x === opened));
    const find = () => list.querySelector(`tr.sd-op[data-rank="${opened.rank}"][data-seq="${opened.seq}"]`);
    reveal(index());
    showDetail(opened, find(), null);
    // a widget is drawn before its output is on the page: scroll once the list is laid out (a few frames at most)
    let frames = 0;
    const scrollWhenShown = () => {
      if (list.isConnected && list.clientHeight) {
        reveal(index());
        const tr = find();
        if (tr) { tr.classList.add("sd-selected"); if (tr.scrollIntoView) tr.scrollIntoView({ block: "nearest" }); }
      } else if (++frames < 300) requestAnimationFrame(scrollWhenShown);
    };
    requestAnimationFrame(scrollWhenShown);
  }
}

export default { render({ model, el }) { renderExplorer(model, el); } };
