import type { IViewModel } from './views';

/** One row of a verification view as the Python side orders and words it (``views.common.table_drawn``). */
interface ITableRow {
  status: string;
  ok: boolean;
  cells: string[];
  titles?: string[];
}

interface ITable {
  verdict: string;
  outcome: string;
  lines: string[];
  headers: string[];
  rows: ITableRow[];
  notes: string[];
}

const MARKS: { [outcome: string]: string } = { ok: '✔', warn: '⚠', fail: '✖' };

function h(tag: string, cls: string, text?: string): HTMLElement {
  const e = document.createElement(tag);
  if (cls) {
    e.className = cls;
  }
  if (text !== undefined) {
    e.textContent = text;
  }
  return e;
}

/** A verification view (check, doctor, smoke): its verdict, its table in the Python side's order, tinted by each
 *  row's status, and a filter that keeps the rows that are not ok (or one status). Every string is set as text. */
export function drawTable(model: IViewModel, el: HTMLElement): void {
  const t = model.get('data') as ITable | undefined;
  if (!t || typeof t.verdict !== 'string' || !Array.isArray(t.headers) || !Array.isArray(t.rows) ||
      !t.rows.every(r => r && Array.isArray(r.cells))) {
    throw new Error('the saved table has no verdict, headers or rows');
  }
  const root = h('div', `sd-root sd-ext-table sd-ext-outcome-${t.outcome}`);
  root.append(h('div', `sd-ext-verdict sd-ext-verdict-${t.outcome}`, `${MARKS[t.outcome] ?? ''} ${t.verdict}`.trim()));
  if (Array.isArray(t.lines) && t.lines.length) {
    const list = h('ul', 'sd-ext-lines');
    list.append(...t.lines.map(line => h('li', '', String(line))));
    root.append(list);
  }
  const statuses = [...new Set(t.rows.map(r => String(r.status)))];
  const notOk = t.rows.filter(r => !r.ok).length;
  const filter = h('select', 'sd-ext-f-status') as HTMLSelectElement;
  const option = (value: string, label: string) => {
    const o = h('option', '', label) as HTMLOptionElement;
    o.value = value;
    filter.append(o);
  };
  option('', `every row (${t.rows.length})`);
  option('not-ok', `not ok (${notOk})`);
  for (const s of statuses) {
    option(`status:${s}`, `${s} (${t.rows.filter(r => String(r.status) === s).length})`);
  }
  const controls = h('div', 'sd-ext-table-controls');
  const label = h('label', '', 'rows ');
  label.append(filter);
  controls.append(label);
  root.append(controls);

  const table = h('table', 'sd-ext-rows');
  const head = h('tr', '');
  head.append(...t.headers.map(name => h('th', '', String(name))));
  const thead = h('thead', '');
  thead.append(head);
  const body = h('tbody', '');
  const rows = t.rows.map(r => {
    const row = h('tr', `sd-ext-row sd-ext-row-${r.ok ? 'ok' : 'bad'} sd-ext-status-${String(r.status)}`);
    row.dataset.status = String(r.status);
    row.dataset.ok = String(Boolean(r.ok));
    r.cells.forEach((cell, k) => {
      const td = h('td', '', String(cell));
      const title = r.titles?.[k];
      if (title) {
        td.title = String(title);
      }
      row.append(td);
    });
    return row;
  });
  body.append(...rows);
  table.append(thead, body);
  const scroll = h('div', 'sd-scroll sd-ext-table-scroll');
  scroll.append(table);
  root.append(scroll);
  for (const note of Array.isArray(t.notes) ? t.notes : []) {
    root.append(h('div', 'sd-ext-note', String(note)));
  }
  filter.addEventListener('change', () => {
    const wanted = filter.value;
    t.rows.forEach((r, k) => {
      const shown = wanted === '' || (wanted === 'not-ok' ? !r.ok : wanted === `status:${String(r.status)}`);
      rows[k].hidden = !shown;
    });
  });
  el.append(root);
}
