// A metric chart on uPlot: the server's downsampled series (min/max band + mean per
// bucket), drag to zoom (refetches that step range at full resolution), double-click to
// zoom out, smoothing, log scale, step or wall-time axis, events as markers.

import { api } from "./api.js";
import { h } from "./dom.js";

const uPlot = window.uPlot;

export const PALETTE = ["#3b82f6", "#e8590c", "#2f9e44", "#ae3ec9", "#0c8599", "#c2255c", "#5c940d", "#1864ab"];

function num(v) {
  if (v === null || v === undefined || typeof v === "string") return null;   // "NaN", "Infinity" → gap
  return v;
}

// The x axis of training charts: "step" or "time" (wall clock, each bucket at the time of
// its earliest point). Remembered per tab (sessionStorage), shared by every chart in it.
const XAXIS_KEY = "gpuplane.xaxis";
export function xAxisPref() {
  try { return sessionStorage.getItem(XAXIS_KEY) === "time" ? "time" : "step"; } catch { return "step"; }
}
export function setXAxisPref(v) {
  try { sessionStorage.setItem(XAXIS_KEY, v === "time" ? "time" : "step"); } catch { /* private mode: this page only */ }
}

// [x, y] pairs ordered by x, for the wall-clock axis: a bucket's time is its earliest
// point's, which need not grow with the step (steps logged again later, by a resumed
// run); uPlot wants ascending x. Buckets without a time (pruned before v8) are left out.
export function byTime(ts, cols) {
  const idx = [];
  for (let i = 0; i < ts.length; i++) if (ts[i] !== null && ts[i] !== undefined) idx.push(i);
  let sorted = true;
  for (let j = 1; j < idx.length; j++) if (ts[idx[j]] < ts[idx[j - 1]]) { sorted = false; break; }
  if (!sorted) idx.sort((a, b) => ts[a] - ts[b] || a - b);
  return [idx.map((i) => ts[i] / 1000), ...cols.map((c) => idx.map((i) => c[i]))];
}

// Buckets per chart: about one per two pixels, enough that the band shows every spike.
export function pointsFor(width) {
  return Math.max(100, Math.min(2000, Math.round(width / 2)));
}

// TensorBoard-style debiased exponential moving average; gaps stay gaps.
export function smooth(ys, weight) {
  if (!weight) return ys;
  const out = new Array(ys.length);
  let last = 0, n = 0;
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y === null || !Number.isFinite(y)) {
      out[i] = null;
      continue;
    }
    last = last * weight + (1 - weight) * y;
    n++;
    out[i] = last / (1 - Math.pow(weight, n));
  }
  return out;
}

function cssVar(name, fallback) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

export class MetricChart {
  // source: async ({from, to, maxPoints}) => {level, points, ts}
  // time: the x values are Unix seconds (the agent's system metrics), drawn as clock time.
  // Otherwise options.xaxis chooses: the step, or each bucket's ts (wall clock).
  constructor({ title, source, color = PALETTE[0], options, markers = [], xLabel = "step", time = false }) {
    this.time = time;
    this.title = title;
    this.source = source;
    this.color = color;
    this.options = options;       // shared {smoothing, log}
    this.markers = markers;       // [{step, label, severity}]
    this.xLabel = xLabel;
    this.zoom = null;             // [from_step, to_step] asked of the server when zoomed in
    this.view = null;             // [min, max] of the x scale when zoomed in (steps or seconds)
    this.raw = null;              // {level, points}
    this.u = null;
    this.status = h("span", { class: "muted small chart-status" });
    this.plotEl = h("div", { class: "plot" });
    this.el = h("figure", { class: "chart card", "data-key": title },
      h("figcaption", { class: "row" }, h("span", { class: "chart-title", text: title }), this.status,
        h("button", { class: "link small zoom-out", hidden: true, onclick: () => this.resetZoom() }, "zoom out")),
      this.plotEl);
    this.zoomBtn = this.el.querySelector(".zoom-out");
    this.loading = null;
  }

  width() {
    return Math.max(240, this.plotEl.clientWidth || this.el.clientWidth - 24 || 600);
  }

  // Training charts on the wall-clock axis (options.xaxis === "time").
  get wall() {
    return !this.time && this.options.xaxis === "time";
  }

  async load() {
    const [from, to] = this.zoom || [null, null];
    const seq = (this._seq = (this._seq || 0) + 1);
    const data = await this.source({ from, to, maxPoints: pointsFor(this.width()) });
    if (seq !== this._seq) return;
    this.raw = data;
    this.draw();
  }

  // Live updates: reload, at most every 2 s, and not while zoomed (the user is reading).
  refresh() {
    if (this.zoom || this.loading) return;
    this.loading = setTimeout(() => {
      this.load().catch(() => {}).finally(() => { this.loading = null; });
    }, 2000);
  }

  data() {
    const pts = (this.raw && this.raw.points) || [];
    const log = this.options.log;
    const pos = (v) => (log && v !== null && v <= 0 ? null : v);
    let xs = pts.map((p) => p[0]);
    let mins = pts.map((p) => pos(num(p[1])));
    let maxs = pts.map((p) => pos(num(p[2])));
    let means = pts.map((p) => pos(num(p[3])));
    if (this.wall) [xs, mins, maxs, means] = byTime((this.raw && this.raw.ts) || [], [mins, maxs, means]);
    return [xs, mins, maxs, means, smooth(means, this.options.smoothing)];
  }

  draw() {
    const data = this.data();
    const level = this.raw ? this.raw.level : 1;
    const n = data[0].length;
    const finite = data.slice(1, 4).reduce((m, col) => Math.max(m, col.filter((v) => v !== null && Number.isFinite(v)).length), 0);
    this.status.textContent = n ? (level > 1 ? `${n} buckets of ${level} steps` : `${n} point${n === 1 ? "" : "s"}`) : "no points yet";
    this.zoomBtn.hidden = !this.zoom;
    if (!finite) {
      // Nothing to draw: say so in the frame rather than draw axes around nothing.
      if (this.u) this.u.destroy();
      this.u = null;
      this.optsKey = null;
      this.plotEl.replaceChildren(h("div", { class: "plot-empty muted", text: n ? `no finite value to draw: ${n === 1 ? "the point is" : `all ${n} points are`} NaN or infinite` : "no points yet" }));
      return;
    }
    const smoothing = this.options.smoothing > 0;
    const wall = this.wall;
    const clock = this.time || wall;
    // A few points make no line: draw each as a dot, so one point is seen.
    const sparse = finite <= 3;
    const optsKey = `${this.options.log}|${smoothing}|${wall}|${sparse}`;
    if (this.u && this.optsKey === optsKey) {
      this.u.setData(data, !this.view);
      this.fitSingle(data);
      if (this.view) this.u.setScale("x", { min: this.view[0], max: this.view[1] });
      return;
    }
    if (this.u) this.u.destroy();
    this.optsKey = optsKey;
    const axisStroke = cssVar("--muted", "#777");
    const grid = { stroke: cssVar("--grid", "rgba(128,128,128,.15)"), width: 1 };
    const band = `${this.color}33`;
    const opts = {
      width: this.width(), height: 200,
      scales: { x: { time: clock, range: (u, lo, hi) => (lo === hi || lo === null ? [(lo ?? 0) - (clock ? 30 : 1), (hi ?? 0) + (clock ? 30 : 1)] : [lo, hi]) }, y: this.options.log ? { distr: 3 } : {} },
      legend: { show: true, live: true },
      cursor: { drag: { x: true, y: false, setScale: false }, points: { size: 5 } },
      series: [
        { label: clock ? "time" : this.xLabel },
        { label: "min", stroke: "transparent", points: { show: false } },
        { label: "max", stroke: "transparent", points: { show: false } },
        { label: smoothing ? "mean (raw)" : "mean", stroke: smoothing ? `${this.color}66` : this.color, width: smoothing ? 1 : 1.5, points: sparse ? { show: true, size: 8, fill: this.color, stroke: this.color } : { show: false } },
        { label: "smoothed", stroke: this.color, width: 1.5, show: smoothing, points: { show: false } },
      ],
      bands: [{ series: [2, 1], fill: band }],
      axes: [
        { stroke: axisStroke, grid, ticks: grid },
        { stroke: axisStroke, grid, ticks: grid, size: 60 },
      ],
      hooks: {
        setSelect: [(u) => {
          if (u.select.width < 4) return;
          const a = u.posToVal(u.select.left, "x");
          const b = u.posToVal(u.select.left + u.select.width, "x");
          u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
          if (this.wall) this.zoomToTime(a, b);
          else if (Math.ceil(b) > Math.floor(a)) this.zoomTo(Math.max(0, Math.floor(a)), Math.ceil(b));
        }],
        draw: [(u) => this.drawMarkers(u)],
      },
    };
    this.plotEl.replaceChildren();
    this.u = new uPlot(opts, data, this.plotEl);
    this.fitSingle(data);
    if (this.view) this.u.setScale("x", { min: this.view[0], max: this.view[1] });
    if (data[0].length && window.gpuplane && !window.gpuplane.firstChartAt) {
      window.gpuplane.firstChartAt = performance.now();     // for bench/dashboard.py
    }
    this.u.over.addEventListener("dblclick", () => this.resetZoom());
    this.u.over.title = "drag to zoom in (full resolution), double-click to zoom out";
  }

  // One x value: uPlot's own range for it spans years on a clock axis. A minute around
  // it on a clock, a few steps around it otherwise.
  fitSingle(data) {
    const xs = data[0];
    if (!xs.length || xs[0] !== xs[xs.length - 1] || this.view) return;
    const pad = this.time || this.wall ? 30 : 1;
    this.u.setScale("x", { min: xs[0] - pad, max: xs[0] + pad });
  }

  drawMarkers(u) {
    if (!this.markers.length) return;
    const ctx = u.ctx;
    const [lo, hi] = [u.scales.x.min, u.scales.x.max];
    ctx.save();
    ctx.lineWidth = 1;
    ctx.setLineDash([4, 3]);
    const wall = this.wall;
    for (const m of this.markers) {
      const at = wall ? (m.ts ? m.ts / 1000 : null) : m.step;
      if (at === null || at === undefined || at < lo || at > hi) continue;
      const x = Math.round(u.valToPos(at, "x", true)) + 0.5;
      ctx.strokeStyle = m.severity === "critical" ? "#e03131" : m.severity === "warning" ? "#f08c00" : "#868e96";
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    }
    ctx.restore();
  }

  async zoomTo(from, to) {
    this.zoom = [from, to];
    this.view = this.wall ? null : [from, to];
    await this.load();
  }

  // Wall-clock zoom: the server is asked by step, so the times [a, b] (seconds) become the
  // steps of the buckets drawn there, widened by one bucket each side (a bucket's time is
  // its first point's, so the one before `a` may hold points after it); the x scale then
  // shows exactly [a, b] of what comes back.
  async zoomToTime(a, b) {
    const pts = (this.raw && this.raw.points) || [];
    const ts = (this.raw && this.raw.ts) || [];
    let first = -1, last = -1;
    for (let i = 0; i < pts.length; i++) {
      const t = ts[i] === null || ts[i] === undefined ? null : ts[i] / 1000;
      if (t === null || t < a || t > b) continue;
      if (first < 0) first = i;
      last = i;
    }
    if (!pts.length) return;
    if (first < 0) {             // no bucket starts inside: the one holding [a, b]
      const after = pts.findIndex((p, i) => ts[i] !== null && ts[i] !== undefined && ts[i] / 1000 > b);
      first = last = Math.max(0, (after < 0 ? pts.length : after) - 1);
    }
    const from = pts[Math.max(0, first - 1)][0];
    const to = last + 1 < pts.length ? pts[last + 1][0] : null;
    this.zoom = [from, to];
    this.view = [a, b];
    await this.load();
  }

  async resetZoom() {
    if (!this.zoom) return;
    this.zoom = null;
    this.view = null;
    await this.load();
  }

  // The step / wall-time toggle: redraw from the data held (its ts came with it); a zoom
  // is left, since its range was on the other axis.
  setAxis() {
    if (this.zoom) {
      this.zoom = null;
      this.view = null;
      return this.load();
    }
    if (this.raw) this.draw();
    return Promise.resolve();
  }

  setMarkers(markers) {
    this.markers = markers;
    if (this.u) this.u.redraw(false);
  }

  resize() {
    if (this.u) this.u.setSize({ width: this.width(), height: 200 });
  }

  destroy() {
    clearTimeout(this.loading);
    if (this.u) this.u.destroy();
    this.u = null;
  }
}

export function seriesSource(runId, key) {
  return async ({ from, to, maxPoints }) => {
    const q = new URLSearchParams({ max_points: maxPoints });
    if (from !== null && from !== undefined) q.set("from_step", from);
    if (to !== null && to !== undefined) q.set("to_step", to);
    return api(`/runs/${runId}/metrics/${key.split("/").map(encodeURIComponent).join("/")}?${q}`);
  };
}
