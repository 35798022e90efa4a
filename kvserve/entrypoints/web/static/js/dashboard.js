// The live dashboard: polls GET /api/dashboard about once a second while it is on screen, shows the
// registry's totals as tiles and the time series as charts. Charts whose series the server does not send
// (speculative decoding, replicas, until the engine has them) stay hidden.

import { LineChart, format } from './charts.js';

// Tiles: the server's totals under their /metrics names, so each reads exactly what a scrape would.
const TILES = [
  { metric: 'kvserve:num_requests_running', label: 'Running', unit: 'count' },
  { metric: 'kvserve:num_requests_waiting', label: 'Waiting', unit: 'count' },
  // Beyond an engine's batch, requests wait in the gateway's queue, not in the engine.
  { metric: 'kvserve:gateway_queue_requests', label: 'Queued', unit: 'count' },
  { metric: 'kvserve:kv_cache_usage_perc', label: 'KV cache used', unit: 'percent' },
  { metric: 'kvserve:request_success_total', label: 'Requests finished', unit: 'count' },
  { metric: 'kvserve:prompt_tokens_total', label: 'Prompt tokens', unit: 'count' },
  { metric: 'kvserve:generation_tokens_total', label: 'Generated tokens', unit: 'count' },
  { metric: 'kvserve:num_preemptions_total', label: 'Preemptions', unit: 'count' },
];

// Charts: [series key in the JSON, legend label].
const CHARTS = [
  { id: 'requests', title: 'Requests', unit: 'count',
    series: [['num_requests_running', 'running'], ['num_requests_waiting', 'waiting'],
      ['gateway_queue_requests', 'queued']] },
  { id: 'kv-cache', title: 'KV-cache usage', unit: 'percent', max: 1, series: [['kv_cache_usage_perc', 'used']] },
  { id: 'prefix-cache', title: 'Prefix-cache hit rate', unit: 'percent', max: 1, note: 'prompt tokens, trailing minute',
    series: [['prefix_cache_hit_rate', 'hit rate']] },
  { id: 'throughput', title: 'Throughput', unit: 'rate', note: 'tokens per second, 5 s average',
    series: [['generation_tokens_per_s', 'generation'], ['prompt_tokens_per_s', 'prompt']] },
  { id: 'ttft', title: 'Time to first token', unit: 'seconds', note: 'trailing minute',
    series: [['ttft_p50_s', 'p50'], ['ttft_p90_s', 'p90'], ['ttft_p99_s', 'p99']] },
  { id: 'itl', title: 'Inter-token latency', unit: 'seconds', note: 'trailing minute',
    series: [['itl_p50_s', 'p50'], ['itl_p90_s', 'p90'], ['itl_p99_s', 'p99']] },
  { id: 'preemptions', title: 'Preemptions', unit: 'count', note: 'since start',
    series: [['num_preemptions_total', 'total']] },
  { id: 'spec-decode', title: 'Speculative acceptance', unit: 'percent', max: 1, note: 'draft tokens accepted',
    series: [['spec_decode_acceptance_rate', 'accepted']] },
];

const WINDOW_KEY = 'kvserve.dashboardWindow';

export class DashboardView {
  constructor({ tiles, charts, status, windowSelect, intervalS = 1 }) {
    this.status = status;
    this.windowSelect = windowSelect;
    const saved = localStorage.getItem(WINDOW_KEY);
    if (saved && [...windowSelect.options].some((o) => o.value === saved)) windowSelect.value = saved;
    windowSelect.addEventListener('change', () => {
      localStorage.setItem(WINDOW_KEY, windowSelect.value);
      this.refresh();
    });
    this.intervalMs = Math.max(500, intervalS * 1000);
    this.timer = null;
    this.running = false;
    this.inFlight = false;   // one request at a time, whatever the user clicks
    this.again = false;      // poll again as soon as the request in flight is answered
    this.tiles = TILES.map((spec) => {
      const tile = document.createElement('div');
      tile.className = 'tile';
      tile.dataset.metric = spec.metric;
      const value = document.createElement('span');
      value.className = 'tile-value';
      value.textContent = '–';
      const label = document.createElement('span');
      label.className = 'tile-label';
      label.textContent = spec.label;
      tile.append(value, label);
      tiles.append(tile);
      return { spec, tile, value };
    });
    this.charts = CHARTS.map((spec) => ({ spec, chart: new LineChart(charts, spec) }));
    for (const { chart } of this.charts) chart.hidden = true;
    this.replicaChart = new LineChart(charts, { id: 'replicas', title: 'Load per replica', unit: 'count',
      note: 'running + waiting requests' });
    this.replicaChart.hidden = true;
  }

  start() {
    this.running = true;
    this.refresh();
  }

  stop() {
    this.running = false;
    clearTimeout(this.timer);
    this.timer = null;
  }

  // Polls now (or right after the request in flight), then once an interval.
  refresh() {
    if (!this.running) return;
    if (this.inFlight) {
      this.again = true;
      return;
    }
    clearTimeout(this.timer);
    this.tick();
  }

  async tick() {
    this.inFlight = true;
    try {
      const response = await fetch(`api/dashboard?window=${Number(this.windowSelect.value)}`, { cache: 'no-store' });
      if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
      this.render(await response.json());
      this.status.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
      this.status.dataset.state = 'live';
    } catch (e) {
      this.status.textContent = `cannot reach the server (${e.message}); retrying`;
      this.status.dataset.state = 'error';
    } finally {
      this.inFlight = false;
      if (this.running) this.timer = setTimeout(() => this.tick(), this.again ? 0 : this.intervalMs);
      this.again = false;
    }
  }

  render(data) {
    for (const { spec, tile, value } of this.tiles) {
      const v = data.totals[spec.metric];
      tile.hidden = v === undefined;
      value.textContent = format(spec.unit, v ?? null);
      value.dataset.value = v === undefined ? '' : String(v);
    }
    for (const { spec, chart } of this.charts) {
      const present = spec.series.filter(([key]) => key in data.series);
      chart.hidden = present.length === 0;
      if (present.length) {
        chart.update(data.time, present.map(([key, label]) => ({ label, values: data.series[key] })), data.window_s);
      }
    }
    const replicas = Object.entries(data.replicas || {});
    this.replicaChart.hidden = replicas.length === 0;
    if (replicas.length) {
      const load = replicas.map(([name, s]) => ({
        label: `replica ${name}`,
        values: (s.num_requests_running || []).map((v, i) => (v === null ? null : v + ((s.num_requests_waiting || [])[i] || 0))),
      }));
      this.replicaChart.update(data.time, load, data.window_s);
    }
  }
}
