// A run: its facts, a chart per metric key (training keys, then system metrics), events as
// markers, checkpoints with evaluate and the recommendation where the server has them.

import { api, optional, canWrite } from "../api.js";
import { h, replace, fmtTime, fmtDuration, fmtNum, stateBadge, jobBadge, isStopped, confirmAction } from "../dom.js";
import { live } from "../live.js";
import { MetricChart, PALETTE, seriesSource, xAxisPref, setXAxisPref } from "../chart.js";
import { eventRow } from "./events.js";
import { errorBox } from "../app.js";

export async function render(root, [id]) {
  const runId = Number(id);
  const [run, summary] = await Promise.all([api(`/runs/${runId}`), api(`/runs/${runId}/metrics`)]);
  const options = { smoothing: 0, log: false, xaxis: xAxisPref() };
  const charts = new Map();
  const head = h("div", { class: "page-head" });
  const facts = h("dl", { class: "facts" });
  const keysTable = h("div", { id: "keys" });
  const verdictEl = h("div", { id: "verdict", "aria-live": "polite" });
  const trainEl = h("div", { class: "charts", id: "charts" });
  const sysEl = h("div", { class: "charts", id: "sys-charts" });
  const eventsEl = h("ul", { class: "events", id: "run-events" });
  const ckptEl = h("div", { id: "checkpoints" });
  const msg = h("div", { class: "msg-area", "aria-live": "polite" });

  const smoothIn = h("input", { type: "range", id: "smoothing", min: 0, max: 0.99, step: 0.01, value: "0", "aria-label": "Smoothing" });
  const smoothOut = h("output", { for: "smoothing", text: "0" });
  const logIn = h("input", { type: "checkbox", id: "logscale" });
  const axisIn = h("select", { id: "xaxis" },
    h("option", { value: "step", text: "step" }), h("option", { value: "time", text: "wall time" }));
  axisIn.value = options.xaxis;
  axisIn.addEventListener("change", () => {
    options.xaxis = axisIn.value;
    setXAxisPref(axisIn.value);
    for (const c of charts.values()) if (!c.time) c.setAxis().catch((err) => { c.status.textContent = err.message; });
  });
  smoothIn.addEventListener("input", () => {
    options.smoothing = Number(smoothIn.value);
    smoothOut.textContent = smoothIn.value;
    for (const c of charts.values()) c.draw();
  });
  logIn.addEventListener("change", () => {
    options.log = logIn.checked;
    for (const c of charts.values()) c.draw();
  });

  let currentRun = run;
  // An early stop or a stop on an event is the job's (gpuplane/states.py): the run shows it
  // as its end, not as a cancel. Looked up once the run has ended CANCELLED.
  let stoppedJob = null;
  async function lookUpStop() {
    if (currentRun.state !== "CANCELLED" || !currentRun.job_id || stoppedJob) return;
    const job = await api(`/jobs/${currentRun.job_id}`).catch(() => null);
    if (job && isStopped(job) && job.attempt === currentRun.attempt) { stoppedJob = job; drawHead(); }
  }
  function drawHead() {
    const r = currentRun;
    const sweep = r.config && r.config.sweep && typeof r.config.sweep === "object" ? r.config.sweep : null;
    replace(head, h("h1", {}, h("span", { class: "muted", text: `run #${r.id} ` }), h("span", { text: r.name || `${r.project}` })),
      stoppedJob ? jobBadge(stoppedJob) : stateBadge(r.state));
    const fact = (k, v) => (v === null || v === undefined || v === "" ? null : [h("dt", { text: k }), h("dd", {}, v)]);
    const cfg = r.config && Object.keys(r.config).length ? h("code", { text: Object.entries(r.config).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ") }) : null;
    replace(facts,
      fact("Job", r.job_id ? h("a", { href: `#/jobs/${r.job_id}`, text: `job #${r.job_id}${r.attempt ? `, attempt ${r.attempt}` : ""}` }) : null),
      fact("Source", r.source),
      fact("Project", r.experiment ? `${r.project} / ${r.experiment}` : r.project),
      fact("Node", r.node ? `${r.node}${r.gpu_indices && r.gpu_indices.length ? ` · GPU ${r.gpu_indices.join(", ")}` : ""}` : null),
      fact("Sweep", sweep ? h("a", { href: `#/sweeps/${sweep.id}`, id: "run-sweep", text: `sweep #${sweep.id}, trial ${sweep.trial}` }) : null),
      fact("Config", cfg),
      fact("Stopped", stoppedJob ? `${stoppedJob.end}: ${(stoppedJob.stop_reason || {}).message || ""}` : null),
      fact("Failure", r.failure_kind && !stoppedJob ? `${r.failure_kind}${r.exit_code !== null && r.exit_code !== undefined ? ` (exit ${r.exit_code})` : ""}` : null),
      fact("Started", r.started_at ? `${fmtTime(r.started_at)} · ${fmtDuration(r.started_at, r.ended_at)}` : fmtTime(r.created_at)));
  }

  // What a key means (its role, its direction) is the server's (gpuplane/vocab.py): each
  // key of the summary carries it; a key first seen live waits for the next summary.
  const roles = new Map();
  const isSystem = (key) => roles.get(key) === "system";
  function drawKeys(keys) {
    for (const k of keys) roles.set(k.key, k.role);
    const train = keys.filter((k) => k.role !== "system");
    replace(keysTable, train.length ? h("table", { class: "table keys" },
      h("thead", {}, h("tr", {}, ["Metric", "Latest", "Best", "at step", "Trend", "Points"].map((t) => h("th", { text: t })))),
      h("tbody", {}, train.map((k) => h("tr", {},
        h("td", {}, h("a", { href: `#chart-${cssId(k.key)}`, text: k.key }), h("span", { class: "muted small goal", text: ` ${goalText(k)}` })),
        h("td", { class: "num", text: k.latest ? fmtNum(k.latest.value) : "" }),
        h("td", { class: "num", text: k.best ? fmtNum(k.best.value) : "" }),
        h("td", { class: "num", text: k.best ? String(k.best.step) : "" }),
        h("td", { class: `trend t-${k.trend}`, text: k.trend || "" }),
        h("td", { class: "num", text: String(k.count) })))))
      : h("p", { class: "muted", text: "No training metrics yet. Log them with the SDK (run.log) or point the job at a TensorBoard dir." }));
  }

  // Charts are built when they scroll into view: a run with many keys stays quick to open.
  const io = new IntersectionObserver((entries) => {
    for (const e of entries) {
      if (!e.isIntersecting) continue;
      io.unobserve(e.target);
      const c = e.target._chart;
      c.load().catch((err) => { c.status.textContent = err.message; });
    }
  }, { rootMargin: "800px" });

  // The run's verdict beside its curves: diagnose_run's answer as the server gives it (the
  // words of `gpuplane diagnose` and `run show`); nothing of it is decided here.
  async function drawVerdict() {
    const d = await optional(`/runs/${runId}/diagnosis`).catch(() => null);
    if (!d) { replace(verdictEl); return; }
    const tone = { healthy: "ok", "too early to tell": "", stalled: "warn", plateaued: "warn" }[d.verdict] ?? "bad";
    replace(verdictEl, h("div", { class: `notice verdict ${tone === "ok" ? "ok" : tone === "bad" ? "error" : ""}`, "data-verdict": d.verdict },
      h("strong", { class: "verdict-word", text: d.verdict.toUpperCase() }), " — ",
      h("span", { class: "verdict-summary", text: d.summary }),
      d.primary_key ? h("span", { class: "muted small", text: ` (judged on ${d.primary_key})` }) : null,
      d.advice ? h("div", { class: "small verdict-advice" }, h("strong", { text: "advice: " }), d.advice) : null,
      d.confidence && d.confidence.level ? h("div", { class: "small muted verdict-confidence", text: `confidence: ${d.confidence.level}${d.confidence.why ? ` — ${d.confidence.why}` : ""}` }) : null,
      d.evidence && d.evidence.length ? h("ul", { class: "small evidence" }, d.evidence.map((e) => h("li", { text: e }))) : null));
  }

  let colour = 0;
  function ensureChart(key) {
    if (charts.has(key)) return charts.get(key);
    const c = new MetricChart({ title: key, source: seriesSource(runId, key), color: PALETTE[colour++ % PALETTE.length], options, markers: isSystem(key) ? [] : markers, time: isSystem(key) });
    c.el.id = `chart-${cssId(key)}`;
    c.el._chart = c;
    charts.set(key, c);
    window.gpuplane.charts[key] = c;
    const target = isSystem(key) ? sysEl : trainEl;
    if (target === sysEl) sysEl.querySelector(":scope > p")?.remove();
    const siblings = [...target.children].filter((x) => x.dataset.key);
    const before = siblings.find((x) => x.dataset.key > key);
    target.insertBefore(c.el, before || null);
    io.observe(c.el);
    return c;
  }

  let markers = [];
  function drawEvents(all) {
    markers = all.filter((e) => e.step !== null && e.step !== undefined)
      .map((e) => ({ step: e.step, ts: e.ts, severity: e.severity, label: e.type }));
    for (const c of charts.values()) if (!c.time) c.setMarkers(markers);
    replace(eventsEl, all.length ? all.slice().reverse().slice(0, 100).map(eventRow) : h("li", { class: "muted", text: "No events for this run." }));
  }

  root.append(head, msg, facts,
    h("section", {}, h("h2", { text: "Metrics" }), verdictEl, keysTable),
    h("div", { class: "row chart-controls" },
      h("label", { for: "smoothing", text: "Smoothing" }), smoothIn, smoothOut,
      h("label", { class: "check" }, logIn, " log scale"),
      h("label", { for: "xaxis", text: "x axis" }), axisIn,
      h("span", { class: "muted small", text: "Drag across a chart to zoom in at full resolution; double-click to zoom out. Dashed lines mark events." })),
    trainEl,
    h("section", {}, h("h2", { text: "System" }), sysEl),
    h("section", {}, h("h2", { text: "Checkpoints" }), ckptEl),
    h("section", {}, h("h2", { text: "Events" }), eventsEl));
  drawHead();
  lookUpStop();
  drawKeys(summary.keys);
  drawVerdict();
  for (const k of summary.keys) ensureChart(k.key);
  if (!summary.keys.some((k) => k.role === "system")) sysEl.append(h("p", { class: "muted", text: "No system metrics for this run." }));
  drawEvents([]);
  loadCheckpoints(runId, ckptEl, msg).catch((e) => replace(ckptEl, errorBox(e)));

  const ro = new ResizeObserver(() => { for (const c of charts.values()) c.resize(); });
  ro.observe(trainEl);

  const runEvents = [];
  const offEvents = live.subscribe(`events:run=${runId}`, (d) => {
    runEvents.push(...d.events);
    drawEvents(runEvents);
  });
  let tips = null;
  let summaryTimer = null;
  const offRun = live.subscribe(`run:${runId}`, (d) => {
    if (d.run) {
      const ended = d.run.state !== currentRun.state;
      currentRun = d.run;
      drawHead();
      if (ended) lookUpStop();
      if (ended) drawVerdict();
    }
    const fresh = d.tips || {};
    let unseen = false;
    for (const [key, step] of Object.entries(fresh)) {
      if (!roles.has(key)) { unseen = true; continue; }      // its role comes with the summary
      const c = ensureChart(key);
      if (tips && tips[key] !== step && c.raw) c.refresh();
    }
    if ((unseen || (tips && JSON.stringify(tips) !== JSON.stringify(fresh))) && !summaryTimer) {
      summaryTimer = setTimeout(async () => {
        summaryTimer = null;
        try {
          const keys = (await api(`/runs/${runId}/metrics`)).keys;
          drawKeys(keys);
          for (const k of keys) ensureChart(k.key);
          await drawVerdict();
        } catch { /* next update */ }
      }, unseen ? 300 : 3000);
    }
    tips = fresh;
  });
  return () => {
    offEvents(); offRun(); io.disconnect(); ro.disconnect(); clearTimeout(summaryTimer);
    for (const c of charts.values()) c.destroy();
  };
}

// The goal of a key as the server decided it: a counter or schedule has none to show, a
// name that says nothing is "goal unknown" (never judged better or worse).
function goalText(k) {
  if (k.direction === "max") return "↑ higher is better";
  if (k.direction === "min") return "↓ lower is better";
  return k.counter ? "" : "goal unknown";
}

function cssId(key) {
  return key.replace(/[^A-Za-z0-9_-]/g, "_");
}

// Checkpoints (issue 11's routes): shown when the server has them. Values are
// {key: {step, value}} (docs/api.md); the recommendation names `checkpoint_id`.
function values(obj) {
  return obj ? Object.entries(obj).map(([k, v]) => `${k} ${fmtNum(v && typeof v === "object" ? v.value : v)}`).join(" · ") : "";
}

function fmtSize(n) {
  if (!n) return "";
  return n >= 2 ** 30 ? `${(n / 2 ** 30).toFixed(1)} GB` : n >= 2 ** 20 ? `${(n / 2 ** 20).toFixed(1)} MB` : `${Math.max(1, Math.round(n / 1024))} KB`;
}

// What retention did with it (docs/checkpoints.md): deleted with the bytes freed, or kept
// and why (pinned, evaluated, best K, last L), as the server recorded it.
function kept(c) {
  if (c.deleted_at) return h("span", { class: "muted deleted", text: `deleted${c.bytes_freed ? ` (${fmtSize(c.bytes_freed)} freed)` : ""}` });
  return [c.pinned ? h("span", { class: "badge pinned", text: "pinned" }) : null,
    c.keep_reason && c.keep_reason !== "pinned" ? h("span", { class: "keep-reason", text: ` ${c.keep_reason}` }) : null];
}

async function loadCheckpoints(runId, el, msg) {
  const data = await optional(`/runs/${runId}/checkpoints?detail=1`);
  if (!data) {
    replace(el, h("p", { class: "muted not-available", text: "Checkpoints are not available on this server yet." }));
    return;
  }
  const list = data.checkpoints || [];
  const rec = list.length ? await optional(`/checkpoints:recommend?run=${runId}`).catch(() => null) : null;
  const best = rec && rec.checkpoint;
  const recId = best ? best.checkpoint_id : null;
  replace(el,
    best ? h("div", { class: "notice ok", id: "recommendation", "data-checkpoint": recId },
      h("strong", { text: "Recommended: " }),
      `checkpoint #${recId}${best.step !== null && best.step !== undefined ? ` at step ${best.step}` : ""}`,
      rec.key ? ` · ${rec.key} ${fmtNum(best.value)} (${best.source === "evaluation" ? "evaluated" : "training value"})` : "",
      rec.reason ? h("span", { class: "small", text: ` — ${rec.reason}` }) : null)
      : rec && rec.reason ? h("p", { class: "muted small", id: "recommendation-none", text: rec.reason }) : null,
    list.length ? h("div", { class: "scroll-x" }, h("table", { class: "table", id: "checkpoint-table" },
      h("thead", {}, h("tr", {}, ["Checkpoint", "Step", "Epoch", "Size", "Metrics", "Evaluations", "Kept", ""].map((t) => h("th", { text: t })))),
      h("tbody", {}, list.map((c) => h("tr", { class: c.id === recId ? "recommended" : "", "data-checkpoint": c.id },
        h("td", {}, h("span", { class: "muted ckpt-id", text: `#${c.id} ` }), h("code", { text: c.path }), c.id === recId ? [" ", h("span", { class: "badge ok", text: "recommended" })] : null),
        h("td", { class: "num", text: c.step ?? "" }),
        h("td", { class: "num", text: c.epoch ?? "" }),
        h("td", { class: "num", text: fmtSize(c.size_bytes) }),
        h("td", { class: "small metrics", text: values(c.metrics) }),
        h("td", { class: "small evaluations" }, (c.evaluations || []).map((e) => h("div", {},
          h("a", { href: `#/jobs/${e.job_id}`, text: `job #${e.job_id}` }), ` ${e.state || ""} ${values(e.results)}`))),
        h("td", { class: "small kept" }, kept(c)),
        h("td", {}, canWrite() && !c.deleted_at ? [h("button", { class: "secondary small pin", "aria-label": `${c.pinned ? "Unpin" : "Pin"} checkpoint #${c.id}`, onclick: async () => {
          try {
            await api(`/checkpoints/${c.id}/pin`, { method: "POST", body: { pinned: !c.pinned } });
            await loadCheckpoints(runId, el, msg);
          } catch (e) {
            replace(msg, errorBox(e));
          }
        } }, c.pinned ? "Unpin" : "Pin"), " ", h("button", { class: "secondary small evaluate", "aria-label": `Evaluate checkpoint #${c.id}`, onclick: async () => {
          if (!(await confirmAction(`Queue an evaluation job for checkpoint #${c.id} (${c.path})?`, "Evaluate"))) return;
          try {
            const ev = await api(`/checkpoints/${c.id}/evaluations`, { method: "POST", body: {} });
            replace(msg, h("div", { class: "notice ok", id: "evaluation-queued", text: `Evaluation #${ev.id} of checkpoint #${c.id} queued as job #${ev.job_id}.` }));
            await loadCheckpoints(runId, el, msg);
          } catch (e) {
            replace(msg, errorBox(e));
          }
        } }, "Evaluate")] : null))))))
      : h("p", { class: "muted", text: "No checkpoints registered for this run." }));
}
