import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

/** The collective a stuck rank waits in (sharddbg/cluster/state_file.py ``StuckCollective``). */
interface IStuckCollective {
  collective: string;
  group: string;
  group_ranks: number[];
  since: number | null;
  missing_ranks: number[];
  description: string;
}

/** A rank as the cluster's state file tells it (sharddbg/cluster/state_file.py). */
interface IRankState {
  rank: number;
  pid: number | null;
  state: string;
  how: string;
  stuck_in?: IStuckCollective | null;
}

/** A cluster as the server answers it: running (its state) or gone (the reason). */
interface ICluster {
  cluster_id: string;
  gone?: string;
  owner_pid?: number | null;
  ranks?: number;
  mesh?: string;
  backend?: string | null;
  patch_mode?: string | null;
  owner_kernel?: string | null;
  rank_states?: IRankState[];
  last_trace?: { label: string; saved: number } | null;
}

/** Opens a cluster's last trace in the main area (``label``: what the panel says of it). */
export type TraceOpener = (clusterId: string, label: string) => void;

/** How long ago ``since`` (seconds since the epoch) was, in words. */
function ago(since: number): string {
  const s = Math.max(0, Math.round(Date.now() / 1000 - since));
  return s < 120 ? `${s} s` : `${Math.floor(s / 60)} min ${s % 60} s`;
}

/** A rank's state in words: idle, busy, "stuck in all_reduce on 'domain' for 12 s, waiting for rank 1", dead. */
function stateText(r: IRankState): string {
  if (r.state === 'dead') {
    return `dead: ${r.how}`;
  }
  const stuck = r.stuck_in;
  if (r.state === 'stuck' && stuck) {
    let text = `stuck in ${stuck.collective} on '${stuck.group}'`;
    if (stuck.since) {
      text += ` since ${new Date(stuck.since * 1000).toLocaleTimeString([], { hour12: false })} (${ago(stuck.since)})`;
    }
    if (stuck.missing_ranks.length) {
      text += `, waiting for rank${stuck.missing_ranks.length > 1 ? 's' : ''} ${stuck.missing_ranks.join(', ')}`;
    }
    return text;
  }
  return r.state;
}

const REFRESH_MS = 1000;

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

/** The left side bar's list of this user's clusters: each with its ranks, mesh, backend, patch mode, owning
 *  kernel and every rank's state, refreshed every second; stop (or reap, once its owner has ended) on a click. */
export class ClusterPanel extends Widget {
  constructor(private openTrace: TraceOpener | null = null) {
    super();
    this.id = 'sharddbg-clusters';
    this.addClass('sd-ext-panel');
    this.title.caption = 'sharddbg clusters';
    this.title.label = 'sharddbg';
    this.node.append(h('div', 'sd-ext-panel-title', 'sharddbg clusters'), this.list, this.status);
    void this.refresh();
    this.timer = window.setInterval(() => void this.refresh(), REFRESH_MS);
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }

  private async request(path: string, method = 'GET'): Promise<Response> {
    const settings = ServerConnection.makeSettings();
    return ServerConnection.makeRequest(URLExt.join(settings.baseUrl, 'sharddbg', path), { method }, settings);
  }

  async refresh(): Promise<void> {
    if (!this.isVisible && this.list.childElementCount) {
      return;
    }
    let clusters: ICluster[];
    try {
      const response = await this.request('clusters');
      if (!response.ok) {
        this.status.textContent = `the server answered ${response.status} (is sharddbg's server extension enabled?)`;
        return;
      }
      clusters = ((await response.json()) as { clusters: ICluster[] }).clusters;
    } catch (err) {
      this.status.textContent = `the server could not be asked (${String(err)})`;
      return;
    }
    this.status.textContent = clusters.length ? '' : 'no cluster of yours runs (sharddbg.Cluster(n=4).start() starts one)';
    this.list.replaceChildren(...clusters.map(c => this.card(c)));
  }

  private card(c: ICluster): HTMLElement {
    const card = h('div', 'sd-ext-cluster');
    card.dataset.clusterId = c.cluster_id;
    card.dataset.state = c.gone ? 'gone' : 'running';
    const head = h('div', 'sd-ext-cluster-head');
    head.append(h('span', 'sd-ext-cluster-id', `cluster ${c.cluster_id}`));
    const action = h('button', 'jp-Button jp-mod-styled sd-ext-stop', c.gone ? 'reap' : 'stop') as HTMLButtonElement;
    action.title = c.gone ? 'kill whatever is left of this cluster and forget it' : 'stop this cluster: kill its ranks and controller';
    action.addEventListener('click', () => void this.stop(c.cluster_id, action));
    head.append(action);
    card.append(head);
    if (c.gone) {
      card.append(h('div', 'sd-ext-gone', `gone: ${c.gone}`));
      return card;
    }
    card.append(
      h('div', 'sd-ext-cluster-facts',
        `${c.ranks} ranks · mesh ${c.mesh} · ${c.backend ?? 'backend ?'} · patches ${c.patch_mode ?? '?'}`),
      h('div', 'sd-ext-cluster-owner',
        `owner: pid ${c.owner_pid}` + (c.owner_kernel ? `, kernel ${c.owner_kernel}` : ' (not a Jupyter kernel)'))
    );
    const ranks = h('table', 'sd-ext-ranks');
    for (const r of c.rank_states ?? []) {
      const row = h('tr', `sd-ext-rank sd-ext-rank-${r.state}`);
      row.dataset.rank = String(r.rank);
      row.dataset.state = r.state;
      const state = h('td', 'sd-ext-rank-state', stateText(r));
      if (r.stuck_in) {
        row.dataset.collective = r.stuck_in.collective;
        state.title = r.stuck_in.description;
      }
      row.append(h('td', '', `rank ${r.rank}`), h('td', '', r.pid === null ? '—' : `pid ${r.pid}`), state);
      ranks.append(row);
    }
    card.append(ranks);
    const last = h('div', 'sd-ext-last-trace');
    if (c.last_trace && this.openTrace) {
      const open = h('button', 'jp-Button jp-mod-styled sd-ext-open-trace', 'open the last trace') as HTMLButtonElement;
      const label = c.last_trace.label;
      open.title = `the cluster's last trace (${label}), with the explorer, the timeline and communication per op`;
      open.addEventListener('click', () => this.openTrace?.(c.cluster_id, label));
      last.append(h('span', '', `last trace: ${label} `), open);
    } else {
      last.textContent = 'no trace yet (%%shard_trace or cl.trace(code) records one)';
    }
    card.append(last);
    return card;
  }

  private async stop(clusterId: string, button: HTMLButtonElement): Promise<void> {
    button.disabled = true;
    try {
      const response = await this.request(`clusters/${encodeURIComponent(clusterId)}/stop`, 'POST');
      if (!response.ok && response.status !== 404) {
        this.status.textContent = `stopping cluster ${clusterId}: the server answered ${response.status}`;
      }
    } catch (err) {
      this.status.textContent = `stopping cluster ${clusterId}: ${String(err)}`;
    }
    await this.refresh();
  }

  private list = h('div', 'sd-ext-clusters');
  private status = h('div', 'sd-ext-panel-status');
  private timer: number;
}
