// Experiments: the training runs of a project / experiment as a table sortable by their best
// value of a metric, their best evaluation and their params (hyperparameters, paths and
// bookkeeping flags left out); tick runs to overlay their curves. Evaluations are not rows:
// each shows beside the training run whose checkpoint it scored.

import { api, optional, canWrite } from "../api.js";
import { h, replace, fmtNum, stateBadge } from "../dom.js";
import { PALETTE, pointsFor, byTime, xAxisPref, setXAxisPref } from "../chart.js";
import { errorBox } from "../app.js";

const uPlot = window.uPlot;

export async function render(root, _params, query) {
  const runs = (await api("/runs?limit=1000&kind=TRAIN")).runs;
  const groups = [...new Set(runs.map((r) => `${r.project}\u0000${r.experiment || ""}`))].sort();
  const pick = h("select", { id: "x-group", "aria-label": "Experiment" },
    groups.map((g) => {
      const [p, e] = g.split("\u0000");
      return h("option", { value: g, text: e ? `${p} / ${e}` : `${p} (no experiment)` });
    }));
  // Opened without a choice: where the newest run was filed on purpose (a project other
  // than "default", or an experiment; runs come newest first), not the first name in the
  // list, which is often "default (no experiment)".
  const newest = runs.find((r) => r.experiment || (r.project && r.project !== "default")) || runs[0];
  if (newest) pick.value = `${newest.project}\u0000${newest.experiment || ""}`;
  if (query.get("project")) {
    const want = `${query.get("project")}\u0000${query.get("experiment") || ""}`;
    if (groups.includes(want)) pick.value = want;
  }
  const keySel = h("select", { id: "x-key", "aria-label": "Metric" });
  // Step, or wall time: runs at different times then sit side by side on the clock.
  const axisSel = h("select", { id: "xaxis" },
    h("option", { value: "step", text: "step" }), h("option", { value: "time", text: "wall time" }));
  axisSel.value = xAxisPref();
  const tableEl = h("div", { class: "scroll-x", id: "x-table" });
  const overlayEl = h("figure", { class: "chart card", id: "overlay" });
  const msg = h("div", { class: "msg-area", "aria-live": "polite" });
  const projectsEl = h("div", { id: "projects" });
  root.append(h("div", { class: "page-head" }, h("h1", { text: "Experiments" })),
    h("div", { class: "filters row" }, pick, h("label", { for: "x-key", text: "ranked by" }), keySel), msg, tableEl,
    h("h2", { text: "Overlay" }),
    h("div", { class: "row" }, h("p", { class: "muted small", text: "Tick runs in the table to overlay their curves of the chosen metric." }),
      h("label", { for: "xaxis", text: "x axis" }), axisSel), overlayEl,
    h("h2", { text: "Projects and experiments" }), projectsEl);

  let rows = [];             // {run, summary: {key: keySummary}}
  let evals = {};            // run id -> its best evaluation by the chosen metric
  const selected = new Set();
  let sort = { col: "best", dir: 1 };
  let overlay = null;

  async function loadGroup() {
    const [p, e] = (pick.value || "").split("\u0000");
    const members = runs.filter((r) => r.project === p && (r.experiment || "") === e).slice(0, 200);
    rows = await Promise.all(members.map(async (run) => {
      const s = await api(`/runs/${run.id}/metrics`).catch(() => ({ keys: [] }));
      return { run, summary: Object.fromEntries(s.keys.map((k) => [k.key, k])) };
    }));
    // roles and directions are the server's (gpuplane/vocab.py)
    const meaning = new Map(rows.flatMap((r) => Object.values(r.summary)).map((k) => [k.key, k]));
    const keys = [...meaning.keys()].filter((k) => meaning.get(k).role !== "system").sort();
    const cur = keySel.value || await primaryKey(p, e);
    replace(keySel, keys.length ? keys.map((k) => h("option", { value: k, text: k })) : h("option", { value: "", text: "no metrics" }));
    keySel.value = keys.includes(cur) ? cur : (keys.find((k) => meaning.get(k).role === "eval" && meaning.get(k).direction) || keys.find((k) => meaning.get(k).direction) || keys[0] || "");
    selected.clear();
    rows.slice(0, 5).forEach((r) => selected.add(r.run.id));
    await loadEvals();
    draw();
    drawOverlay();
  }

  async function loadEvals() {
    const [p, e] = (pick.value || "").split("\u0000");
    const q = new URLSearchParams({ project: p, kind: "TRAIN", best_evaluation: "1", limit: "1000" });
    if (e) q.set("experiment", e);
    if (keySel.value) q.set("key", keySel.value);
    const got = await optional(`/runs?${q}`).catch(() => null);
    evals = Object.fromEntries(((got && got.runs) || []).map((r) => [r.id, r.best_evaluation]));
  }

  async function primaryKey(p, e) {
    const q = new URLSearchParams({ project: p });
    if (e) q.set("experiment", e);
    const d = await optional(`/metric-definitions?${q}`).catch(() => null);
    return (d && d.primary && d.primary.key) || "";
  }

  function evalOf(r) {
    const e = evals[r.run.id];
    return e && typeof e.value === "number" ? e.value : null;
  }

  function bestOf(r) {
    const k = r.summary[keySel.value];
    const v = k && k.best ? k.best.value : null;
    return typeof v === "number" ? v : null;
  }

  function draw() {
    const key = keySel.value;
    const dirMax = rows.some((r) => r.summary[key] && r.summary[key].direction === "max");
    // params that differ between the runs first, then the rest, at most 8
    const allKeys = [...new Set(rows.flatMap((r) => Object.keys(r.run.params || {})))].sort();
    const differs = (k) => new Set(rows.map((r) => JSON.stringify((r.run.params || {})[k]))).size > 1;
    const cfgKeys = [...allKeys.filter(differs), ...allKeys.filter((k) => !differs(k))].slice(0, 8);
    const val = (r, col) => col === "best" ? bestOf(r) : col === "eval" ? evalOf(r) : col === "id" ? r.run.id
      : col.startsWith("cfg:") ? (r.run.params || {})[col.slice(4)] : null;
    const sorted = rows.slice().sort((a, b) => {
      let x = val(a, sort.col), y = val(b, sort.col);
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      const d = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
      const better = (sort.col === "best" || sort.col === "eval") && dirMax ? -1 : 1;
      return d * sort.dir * better;
    });
    const th = (col, label) => h("th", { "aria-sort": sort.col === col ? (sort.dir > 0 ? "ascending" : "descending") : "none" },
      h("button", { class: "link sort", "data-col": col, onclick: () => { sort = { col, dir: sort.col === col ? -sort.dir : 1 }; draw(); } }, label));
    replace(tableEl, rows.length ? h("table", { class: "table", id: "x-runs" },
      h("thead", {}, h("tr", {}, h("th", { text: "Overlay" }), th("id", "Run"), h("th", { text: "State" }),
        th("best", `Best ${key}${dirMax ? " ↑" : " ↓"}`), h("th", { text: "at step" }), h("th", { text: "Latest" }),
        th("eval", "Best evaluation"),
        cfgKeys.map((c) => th(`cfg:${c}`, c)))),
      h("tbody", {}, sorted.map((r, i) => {
        const k = r.summary[key];
        const box = h("input", { type: "checkbox", "aria-label": `overlay run ${r.run.id}`, checked: selected.has(r.run.id),
          onchange: () => { box.checked ? selected.add(r.run.id) : selected.delete(r.run.id); drawOverlay(); } });
        return h("tr", { class: i === 0 && bestOf(r) !== null && sort.col === "best" ? "leader" : "" },
          h("td", {}, box),
          h("td", {}, h("a", { href: `#/runs/${r.run.id}` }, h("span", { class: "muted", text: `#${r.run.id} ` }), h("span", { text: r.run.name || "" }))),
          h("td", {}, stateBadge(r.run.state)),
          h("td", { class: "num", text: k && k.best ? fmtNum(k.best.value) : "–" }),
          h("td", { class: "num", text: k && k.best ? String(k.best.step) : "" }),
          h("td", { class: "num", text: k && k.latest ? fmtNum(k.latest.value) : "" }),
          h("td", { class: "num", title: evals[r.run.id] ? `${evals[r.run.id].key}, checkpoint ${evals[r.run.id].checkpoint_id} (step ${evals[r.run.id].step})` : "",
            text: evalOf(r) !== null ? `${fmtNum(evalOf(r))} (ckpt ${evals[r.run.id].checkpoint_id})` : "–" }),
          cfgKeys.map((c) => { const v = (r.run.params || {})[c]; return h("td", { class: "small", text: v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v) }); }));
      }))) : h("p", { class: "muted", text: "No runs in this experiment." }));
  }

  async function drawOverlay() {
    const key = keySel.value;
    const ids = [...selected];
    if (overlay) { overlay.destroy(); overlay = null; }
    replace(overlayEl);
    if (!key || !ids.length) {
      overlayEl.append(h("p", { class: "muted", text: "Nothing to overlay." }));
      return;
    }
    const width = Math.max(300, overlayEl.clientWidth - 24);
    const data = await api(`/metrics/series?runs=${ids.join(",")}&key=${encodeURIComponent(key)}&max_points=${pointsFor(width)}`);
    const present = data.series.filter((s) => !s.missing);
    const wall = axisSel.value === "time";
    const mean = (s) => s.points.map((p) => (typeof p[3] === "number" ? p[3] : null));
    const joined = uPlot.join(present.map((s) => (wall ? byTime(s.ts || [], [mean(s)]) : [s.points.map((p) => p[0]), mean(s)])));
    const muted = getComputedStyle(document.documentElement).getPropertyValue("--muted").trim() || "#777";
    overlay = new uPlot({
      width, height: 260, scales: { x: { time: wall } },
      series: [{ label: wall ? "time" : "step" }, ...present.map((s, i) => ({ label: `run #${s.run_id}`, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true, points: { show: false } }))],
      axes: [{ stroke: muted, grid: { stroke: "rgba(128,128,128,.15)" } }, { stroke: muted, size: 60, grid: { stroke: "rgba(128,128,128,.15)" } }],
    }, joined, overlayEl);
    window.gpuplane.charts.overlay = { u: overlay };
  }

  pick.addEventListener("change", () => loadGroup().catch((e) => replace(msg, errorBox(e))));
  keySel.addEventListener("change", () => {
    loadEvals().then(draw).catch((e) => replace(msg, errorBox(e)));
    drawOverlay().catch((e) => replace(msg, errorBox(e)));
  });
  axisSel.addEventListener("change", () => {
    setXAxisPref(axisSel.value);
    drawOverlay().catch((e) => replace(msg, errorBox(e)));
  });
  if (groups.length) await loadGroup();
  else replace(tableEl, h("p", { class: "muted", text: "No runs yet." }));
  await loadProjects(projectsEl, msg);
  return () => { if (overlay) overlay.destroy(); };
}

function describe(p) {
  const parts = [];
  if (typeof p.experiments === "number") parts.push(`${p.experiments} experiment${p.experiments === 1 ? "" : "s"}`);
  else if (Array.isArray(p.experiments)) parts.push(p.experiments.map((e) => (typeof e === "string" ? e : e.name)).join(", "));
  if (typeof p.runs === "number") parts.push(`${p.runs} run${p.runs === 1 ? "" : "s"}`);
  if (p.description) parts.push(p.description);
  return parts.join(" · ");
}

// Projects (issue 11's routes): list and create where the server has them.
async function loadProjects(el, msg) {
  const data = await optional("/projects").catch(() => null);
  if (!data) {
    replace(el, h("p", { class: "muted not-available", text: "Managing projects is not available on this server yet; runs are grouped by the project and experiment they name." }));
    return;
  }
  const projects = data.projects || [];
  const name = h("input", { id: "p-name", placeholder: "new project name", "aria-label": "New project name", required: true });
  replace(el, h("ul", { class: "plain" }, projects.map((p) => h("li", {}, h("strong", { text: p.name }),
    h("span", { class: "muted", text: ` · ${describe(p)}` })))),
  canWrite() ? h("form", { class: "row", onsubmit: async (ev) => {
    ev.preventDefault();
    try {
      await api("/projects", { method: "POST", body: { name: name.value.trim() } });
      await loadProjects(el, msg);
    } catch (e) {
      replace(msg, errorBox(e));
    }
  } }, name, h("button", { type: "submit", text: "Create project" })) : null);
}
