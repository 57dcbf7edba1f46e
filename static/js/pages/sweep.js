// One sweep: its state, the best trial so far, the trials table, and a parameter against
// the decisive metric (a scatter on a canvas: one dot per trial, coloured by its state).

import { api, canWrite } from "../api.js";
import { h, replace, fmtNum, stateBadge, confirmAction } from "../dom.js";
import { live } from "../live.js";

const COLOURS = { SUCCEEDED: "--ok", EARLY_STOPPED: "--warn", STOPPED_ON_EVENT: "--bad", STOPPING: "--warn",
  FAILED: "--bad", RUNNING: "--accent", CANCELLED: "--muted" };
const STOPPED = new Set(["EARLY_STOPPED", "STOPPED_ON_EVENT", "STOPPING"]);
const FINAL = new Set(["DONE", "STOPPED", "CANCELLED"]);

function colour(state) {
  const name = COLOURS[state] || "--muted";
  return getComputedStyle(document.body).getPropertyValue(name).trim() || "#888";
}

export async function render(root, [id]) {
  const head = h("div", { class: "page-head" });
  const facts = h("div", { class: "card", id: "sweep-facts" });
  const pick = h("select", { id: "scatter-param", "aria-label": "Parameter", onchange: () => plot() });
  const canvas = h("canvas", { id: "scatter", width: 640, height: 320, role: "img",
    "aria-label": "parameter against the metric, one dot per trial" });
  const legend = h("div", { class: "legend small", id: "scatter-legend" });
  const body = h("tbody", { id: "trials-body" });
  const table = h("table", { class: "table trials" }, h("thead", {}, h("tr", { id: "trials-head" })), body);
  root.append(head, facts,
    h("section", { class: "card" }, h("h2", { text: "Parameter against the metric" }),
      h("div", { class: "row" }, h("label", { text: "x: " }, pick)), h("div", { class: "scroll-x" }, canvas), legend),
    h("section", {}, h("h2", { text: "Trials" }), h("div", { class: "scroll-x" }, table)));
  const rec = h("div", { class: "card", id: "sweep-recommend" });
  root.insertBefore(rec, facts.nextSibling);
  let sweep = null;
  window.gpuplane.sweep = { points: [] };

  async function load() {
    sweep = await api(`/sweeps/${id}`);
    draw();
    // the checkpoint to keep across every trial (as `gpuplane ckpt recommend --sweep`)
    const r = await api(`/checkpoints:recommend?sweep=${id}`).catch(() => null);
    const c = r && r.checkpoint;
    replace(rec, h("h2", { text: "Checkpoint to keep" }), c
      ? h("p", { id: "recommended" }, h("a", { href: `#/runs/${c.run_id}`, text: `checkpoint ${c.checkpoint_id}` }),
        ` of run ${c.run_id} at step ${c.step}: ${r.key} = ${fmtNum(c.value)} (${c.source}) · `,
        h("code", { text: c.path || "" }), h("div", { class: "muted small", text: r.reason || "" }))
      : h("p", { class: "muted", id: "recommended", text: (r && r.reason) || "no checkpoint yet" }));
  }

  function draw() {
    const s = sweep;
    const m = s.metric || {};
    replace(head, h("h1", { text: `Sweep #${s.id} ${s.name}` }), stateBadge(s.state),
      canWrite() && s.state === "RUNNING" ? h("button", { class: "danger", id: "cancel-sweep", onclick: async () => {
        if (!(await confirmAction(`Cancel sweep ${s.id} and its active trials?`, "Cancel sweep"))) return;
        await api(`/sweeps/${s.id}/cancel`, { method: "POST", body: {} });
        load();
      } }, "Cancel sweep") : null);
    const b = s.best;
    replace(facts,
      h("p", {}, `${s.trials} trials, ${s.parallel} at once · ${s.project} / ${s.experiment || "-"} · metric `,
        h("strong", { text: m.key || "none yet" }), m.direction ? ` (${m.direction}, from the ${m.from})` : ""),
      s.sampler ? h("p", { class: "muted", text: `sampler: ${s.sampler} (Optuna)` }) : null,
      s.early_stopping ? h("p", { class: "muted", text: "early stopping: " + Object.entries(s.early_stopping).map(([k, v]) => `${k} ${v}`).join(", ") }) : null,
      s.stop_reason ? h("p", { class: "notice error", id: "stop-reason", text: `stopped: ${s.stop_reason}` }) : null,
      Object.keys(s.trial_states || {}).length ? h("p", { id: "trial-counts", class: "muted" }, "trials: " + Object.entries(s.trial_states).map(([k, n]) => `${n} ${k.toLowerCase().replaceAll("_", "-")}`).join(", ")) : null,
      !b && s.best_missing ? h("p", { id: "best", class: "muted" }, `best: none (${s.best_missing})`) : null,
      b ? h("p", { id: "best" }, FINAL.has(s.state) ? "best: " : "best so far: ", h("a", { href: `#/runs/${b.run_id}`, text: `trial ${b.trial}` }),
        ` ${m.key} = ${fmtNum(b.value)} at step ${b.step} · ` + Object.entries(b.params).map(([k, v]) => `${k}=${v}`).join(" ")) : null);
    const names = Object.keys(s.parameters);
    if (!pick.options.length) replace(pick, names.map((n) => h("option", { value: n, text: n })));
    replace(document.getElementById("trials-head"), ["Trial", "State", ...names, m.key || "value", "At step", "Note"].map((t) => h("th", { text: t })));
    replace(body, s.trials_detail.map((t) => h("tr", { "data-trial": t.number, class: b && b.trial === t.number ? "leader" : "" },
      h("td", {}, t.job_id ? h("a", { href: `#/jobs/${t.job_id}`, text: `#${t.number}` }) : h("span", { text: `#${t.number}` })),
      h("td", {}, stateBadge(t.state)),
      names.map((n) => h("td", { class: "num", text: t.params ? String(t.params[n]) : "" })),   // null: a sampler's trial not asked yet
      h("td", { class: "num", text: t.value ? fmtNum(t.value.value) : "" }),
      h("td", { class: "num", text: t.value ? String(t.value.step) : "" }),
      h("td", { class: "small", text: t.stopped ? t.stopped.message : t.state === "FAILED" ? (t.failure_kind || "") : "" }))));
    plot();
  }

  function plot() {
    const s = sweep;
    const name = pick.value;
    const spec = s.parameters[name];
    const log = spec && !Array.isArray(spec) && spec.type === "log_uniform";
    const pts = s.trials_detail.filter((t) => t.params && t.value && typeof t.value.value === "number")
      .map((t) => ({ trial: t.number, x: t.params[name], y: t.value.value, state: t.state }));
    const categorical = pts.some((p) => typeof p.x !== "number");
    const cats = categorical ? [...new Set(s.trials_detail.filter((t) => t.params).map((t) => String(t.params[name])))] : [];
    const dpr = window.devicePixelRatio || 1;
    const W = Math.min(640, (canvas.parentElement && canvas.parentElement.clientWidth) || 640), H = 320;
    canvas.width = W * dpr; canvas.height = H * dpr;
    canvas.style.width = `${W}px`; canvas.style.height = `${H}px`;
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, W, H);
    const fg = getComputedStyle(document.body).color;
    g.fillStyle = fg; g.strokeStyle = fg; g.font = "11px system-ui, sans-serif";
    const L = 56, R = 12, T = 12, B = 32;
    g.globalAlpha = 0.4;
    g.strokeRect(L, T, W - L - R, H - T - B);
    g.globalAlpha = 1;
    window.gpuplane.sweep.points = [];
    if (!pts.length) {
      g.fillText("no trial has a value of the metric yet", L + 10, T + 20);
      return;
    }
    const fx = (v) => (categorical ? cats.indexOf(String(v)) : log ? Math.log10(v) : v);
    const xs = pts.map((p) => fx(p.x)), ys = pts.map((p) => p.y);
    let [x0, x1] = categorical ? [-0.5, cats.length - 0.5] : [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const px = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R - 16) + 8;
    const py = (v) => T + 8 + (1 - (v - y0) / (y1 - y0)) * (H - T - B - 16);
    g.textAlign = "right";
    for (const v of [y0, (y0 + y1) / 2, y1]) g.fillText(fmtNum(v), L - 4, py(v) + 4);
    g.textAlign = "center";
    const ticks = categorical ? cats.map((c, i) => [i, c]) : [x0, (x0 + x1) / 2, x1].map((v) => [v, fmtNum(log ? 10 ** v : v)]);
    for (const [v, label] of ticks) g.fillText(label, px(v), H - B + 14);
    g.fillText(`${name}${log ? " (log scale)" : ""}`, L + (W - L - R) / 2, H - 4);
    // the y axis: the metric that decides, and which way is better
    const m = s.metric || {};
    g.save();
    g.translate(12, T + (H - T - B) / 2);
    g.rotate(-Math.PI / 2);
    g.fillStyle = fg;
    g.fillText(`${m.key || "value"}${m.direction ? ` (${m.direction === "min" ? "lower" : "higher"} is better)` : ""}`, 0, 0);
    g.restore();
    for (const p of pts) {
      const cx = px(fx(p.x)), cy = py(p.y);
      g.beginPath();
      g.arc(cx, cy, s.best && s.best.trial === p.trial ? 6 : 4, 0, 2 * Math.PI);
      if (STOPPED.has(p.state)) {     // a stopped trial: a ring (its value is where it stopped)
        g.strokeStyle = colour(p.state); g.lineWidth = 2; g.stroke(); g.lineWidth = 1;
      } else {
        g.fillStyle = colour(p.state); g.fill();
      }
      window.gpuplane.sweep.points.push({ trial: p.trial, x: p.x, y: p.y, cx, cy, state: p.state });
    }
    const seen = [...new Set(pts.map((p) => p.state))];
    replace(legend, seen.map((st) => h("span", { class: "legend-item", "data-state": st },
      h("span", { class: STOPPED.has(st) ? "dot ring" : "dot", style: `${STOPPED.has(st) ? "border-color" : "background"}: ${colour(st)}` }),
      ` ${st.toLowerCase().replaceAll("_", "-")} `)),
      s.best ? h("span", { class: "legend-item muted" }, " · the larger dot is the best trial") : null);
  }

  await load();
  let pending = null;
  const off = live.subscribe("status", () => {
    if (pending) return;
    pending = setTimeout(() => { pending = null; load().catch(() => {}); }, 1000);
  });
  const timer = setInterval(() => { if (sweep && sweep.state === "RUNNING") load().catch(() => {}); }, 3000);
  return () => { off(); clearTimeout(pending); clearInterval(timer); };
}
