// Overview: nodes and their GPUs (live readings, which job holds each slot), the queue in
// order with why each job waits, running jobs, recent events.

import { h, replace, fmtAgo, fmtNum, fmtTime, stateBadge } from "../dom.js";
import { live } from "../live.js";
import { eventRow } from "./events.js";

export function render(root) {
  const nodesEl = h("div", { class: "nodes", id: "nodes" }, h("p", { class: "muted", text: "Waiting for the first update…" }));
  const queueEl = h("ol", { class: "queue", id: "queue" });
  const runningEl = h("div", { id: "running" });
  const eventsEl = h("ul", { class: "events", id: "recent-events" });
  const summary = h("p", { class: "muted summary", id: "summary" });
  root.append(
    h("div", { class: "page-head" }, h("h1", { text: "Overview" }), summary),
    h("section", { "aria-labelledby": "h-nodes" }, h("h2", { id: "h-nodes", text: "Nodes" }), nodesEl),
    h("div", { class: "cols" },
      h("section", { "aria-labelledby": "h-queue" }, h("h2", { id: "h-queue", text: "Queue" }), queueEl),
      h("section", { "aria-labelledby": "h-running" }, h("h2", { id: "h-running", text: "Running" }), runningEl)),
    h("section", { "aria-labelledby": "h-events" }, h("h2", { id: "h-events", text: "Recent events" }), eventsEl));

  const recent = [];
  const offStatus = live.subscribe("status", (s) => renderStatus(s, { nodesEl, queueEl, runningEl, summary }));
  const offEvents = live.subscribe("events", (d) => {
    recent.push(...d.events);
    recent.splice(0, Math.max(0, recent.length - 20));
    replace(eventsEl, recent.length ? recent.slice().reverse().map(eventRow)
      : h("li", { class: "muted", text: "No events yet." }));
  });
  replace(eventsEl, h("li", { class: "muted", text: "No events yet." }));
  return () => { offStatus(); offEvents(); };
}

// Exported for the benchmark: one full refresh of the overview from a status message.
export function renderStatus(s, { nodesEl, queueEl, runningEl, summary }) {
  const gpus = s.nodes.reduce((n, x) => n + x.gpus.length, 0);
  const busy = s.nodes.reduce((n, x) => n + x.gpus.filter((g) => g.job_id).length, 0);
  const up = s.nodes.filter((n) => n.state === "connected").length;
  summary.textContent = `${up} of ${s.nodes.length} nodes connected · ${busy} of ${gpus} GPUs in use · ${s.queue.length} queued`;
  const names = new Map(s.running.map((j) => [j.id, j.name]));
  renderNodes(nodesEl, s.nodes, names, (s.reservations || [])[0]);
  // The queue and the running table are rebuilt only when what they show changed (the
  // running table also every 30 s, for its "since" column).
  const queueKey = JSON.stringify(s.queue.map((j) => [j.id, j.name, j.gpus, j.cpu_only, j.priority, j.pending_reason]));
  if (queueEl._key !== queueKey) {
    queueEl._key = queueKey;
    replace(queueEl, s.queue.length ? s.queue.map((j, i) => h("li", {},
      h("a", { href: `#/jobs/${j.id}` }, `#${j.id} `, h("span", { text: j.name })),
      h("span", { class: "muted" }, ` · ${j.cpu_only ? "CPU" : `${j.gpus} GPU${j.gpus === 1 ? "" : "s"}`} · priority ${j.priority}`),
      h("div", { class: "why", text: j.pending_reason || (i === 0 ? "next when a slot frees" : `behind ${i} job${i === 1 ? "" : "s"}`) })))
      : h("li", { class: "muted", text: "Nothing is waiting." }));
  }
  const runningKey = JSON.stringify(s.running.map((j) => [j.id, j.name, j.state, j.node, j.gpu_indices]));
  const now = Date.now();
  if (runningEl._key !== runningKey || now - (runningEl._at || 0) > 30000) {
    runningEl._key = runningKey;
    runningEl._at = now;
    replace(runningEl, s.running.length ? h("table", { class: "table" },
      h("thead", {}, h("tr", {}, ["Job", "State", "Node", "Slots", "Since"].map((t) => h("th", { text: t })))),
      h("tbody", {}, s.running.map((j) => h("tr", {},
        h("td", {}, h("a", { href: `#/jobs/${j.id}` }, `#${j.id} `, h("span", { text: j.name }))),
        h("td", {}, stateBadge(j.state)),
        h("td", { text: j.node || "" }),
        h("td", { text: j.cpu_only ? "CPU" : (j.gpu_indices || []).map((i) => `GPU ${i}`).join(", ") }),
        h("td", { text: fmtAgo(j.started_at || j.created_at) })))))
      : h("p", { class: "muted", text: "No job is running." }));
  }
}

// Node cards are kept between refreshes and only the values that changed are written:
// a refresh of 32 nodes x 8 GPUs touches a few hundred text nodes, not 3000 elements.
const cards = new WeakMap();       // nodesEl -> Map(name -> card)

function setText(el, text) {
  if (el.textContent !== text) el.textContent = text;
}

function setBar(fill, frac, label, cls) {
  // A transform, not a width: the bar moves without a layout pass.
  const t = `scaleX(${Math.max(0, Math.min(1, frac || 0)).toFixed(3)})`;
  if (fill.style.transform !== t) fill.style.transform = t;
  const c = `fill ${cls}`;
  if (fill.className !== c) fill.className = c;
  if (fill.parentNode.title !== label) {
    fill.parentNode.title = label;
    fill.parentNode.setAttribute("aria-label", label);
  }
}

function bar() {
  const fill = h("span", { class: "fill" });
  return [h("span", { class: "bar", role: "img" }, fill), fill];
}

function renderNodes(nodesEl, nodes, names, held) {
  let known = cards.get(nodesEl);
  if (!known) {
    known = new Map();
    cards.set(nodesEl, known);
  }
  if (!nodes.length) {
    known.clear();
    replace(nodesEl, h("div", { class: "notice" }, "No node has connected yet. Start an agent on a GPU host: ",
      h("code", { text: "gpuplane-agent --server URL --token TOKEN" }), " (or ",
      h("code", { text: "--fake-gpus 2" }), " to try it without GPUs)."));
    return;
  }
  const order = [];
  for (const n of nodes) {
    let card = known.get(n.name);
    const shape = n.gpus.map((g) => `${g.index}:${g.name}:${g.memory_total_mb}`).join(",") + `|${n.fake}`;
    if (!card || card.shape !== shape) {
      card = nodeCard(n);
      card.shape = shape;
      known.set(n.name, card);
    }
    updateCard(card, n, names, held);
    order.push(card.el);
  }
  const wanted = new Set(nodes.map((n) => n.name));
  for (const name of known.keys()) if (!wanted.has(name)) known.delete(name);
  // Put the cards in order, moving only those out of place.
  if (nodesEl.children.length !== order.length || order.some((el, i) => nodesEl.children[i] !== el)) {
    replace(nodesEl, order);
  }
}

function nodeCard(n) {
  const state = h("span", { class: "badge" });
  const host = h("span", { class: "muted grow right" });
  const rows = n.gpus.map((g) => {
    const [utilBar, utilFill] = bar();
    const [memBar, memFill] = bar();
    const r = {
      utilFill, memFill,
      util: h("span", { class: "num" }), mem: h("span", { class: "num" }),
      temp: h("td", { class: "num" }), power: h("td", { class: "num" }), job: h("td"), jobId: undefined,
    };
    r.el = h("tr", { "data-gpu": g.index },
      h("td", {}, h("span", { text: `${g.index}` }), h("span", { class: "muted small", text: ` ${g.name || ""}` })),
      h("td", {}, h("div", { class: "meter" }, utilBar, r.util)),
      h("td", {}, h("div", { class: "meter" }, memBar, r.mem)),
      r.temp, r.power, r.job);
    return r;
  });
  const cpu = h("p", { class: "small" });
  const el = h("article", { class: "card node", "data-node": n.name },
    h("header", { class: "row" }, h("h3", { text: n.name }), state,
      n.fake ? h("span", { class: "badge muted", text: "fake GPUs" }) : null,
      n.runner === "slurm" ? h("span", { class: "badge muted", text: "Slurm" }) : null, host),
    n.runner === "slurm" ? h("p", { class: "small muted slurm-offer", text: slurmOffer(n) }) : null,
    rows.length ? h("table", { class: "table gpus" },
      h("thead", {}, h("tr", {}, ["GPU", "Utilisation", "Memory", "Temp", "Power", "Job"].map((t) => h("th", { text: t })))),
      h("tbody", {}, rows.map((r) => r.el))) : null,
    cpu);
  return { el, state, host, rows, cpu, cpuKey: null };
}

function updateCard(card, n, names, held) {
  const connected = n.state === "connected";
  card.el.classList.toggle("down", !connected);
  setText(card.state, n.state);
  const cls = `badge ${connected ? "ok" : "warn"}`;
  if (card.state.className !== cls) card.state.className = cls;
  setText(card.host, connected ? hostLine(n.host || {}) : `last seen ${fmtAgo(n.last_seen)}`);
  n.gpus.forEach((g, i) => {
    const r = card.rows[i];
    const memFrac = g.memory_total_mb ? (g.mem_used_mb || 0) / g.memory_total_mb : 0;
    setBar(r.utilFill, (g.util || 0) / 100, `utilisation ${g.util ?? "?"} %`, heat(g.util));
    setText(r.util, g.util === null || g.util === undefined ? "–" : `${Math.round(g.util)} %`);
    setBar(r.memFill, memFrac, `memory ${g.mem_used_mb ?? "?"} of ${g.memory_total_mb} MB`, heat(memFrac * 100));
    setText(r.mem, `${fmtGB(g.mem_used_mb)} / ${fmtGB(g.memory_total_mb)}`);
    setText(r.temp, g.temp_c === null || g.temp_c === undefined ? "–" : `${Math.round(g.temp_c)} °C`);
    setText(r.power, g.power_w === null || g.power_w === undefined ? "–" : `${Math.round(g.power_w)} W`);
    // a free GPU backfill holds for the queue's head says so (docs/scheduling.md)
    const hold = !g.job_id && held && held.node === n.name && held.gpus.includes(g.index) ? held : null;
    const jobKey = g.job_id ? `${g.job_id}:${names.get(g.job_id) || ""}` : hold ? `held:${hold.job_id}:${hold.start}` : null;
    if (r.jobId !== jobKey) {
      r.jobId = jobKey;
      replace(r.job, g.job_id ? h("a", { href: `#/jobs/${g.job_id}` }, `#${g.job_id} `, h("span", { text: names.get(g.job_id) || "" }))
        : hold ? h("span", { class: "held small", title: hold.start ? `reserved for job ${hold.job_id} from ${fmtTime(hold.start)}` : `held for job ${hold.job_id}, next on this node` },
          "held for ", h("a", { href: `#/jobs/${hold.job_id}`, text: `#${hold.job_id}` }),
          hold.start ? ` · ${new Date(hold.start).toTimeString().slice(0, 5)}` : " · next")
          : h("span", { class: "muted", text: "free" }));
    }
  });
  const cpuKey = (n.cpu_jobs || []).map((id) => `${id}:${names.get(id) || ""}`).join(",");
  if (card.cpuKey !== cpuKey) {
    card.cpuKey = cpuKey;
    replace(card.cpu, cpuKey ? [n.runner === "slurm" ? `Slurm jobs (${n.cpu_jobs.length}/${n.cpu_slots}): ` : "CPU jobs: ", n.cpu_jobs.map((id) => h("a", { href: `#/jobs/${id}`, class: "chip" }, `#${id} `, h("span", { text: names.get(id) || "" })))] : []);
    card.cpu.hidden = !cpuKey;
  }
}

// A Slurm agent's node (docs/slurm.md): what its partition offers, and its job slots.
function slurmOffer(n) {
  const o = n.slurm || {};
  if (o.error) return `Slurm partition ${o.partition || "(default)"}: sinfo failed: ${o.error}`;
  return `Slurm partition ${o.partition || "(default)"}: ${o.nodes} node${o.nodes === 1 ? "" : "s"}, up to ${o.max_gpus} GPUs, ${o.cpus} CPUs and ${fmtGB(o.mem_mb)} a node, time limit ${o.time_limit}; ${n.cpu_slots} jobs at once`;
}

function hostLine(host) {
  const parts = [];
  if (host.cpu !== undefined && host.cpu !== null) parts.push(`CPU ${Math.round(host.cpu)} %`);
  if (host.mem_used_mb !== undefined && host.mem_total_mb) parts.push(`RAM ${fmtGB(host.mem_used_mb)} / ${fmtGB(host.mem_total_mb)}`);
  if (host.disk_free_mb !== undefined) parts.push(`disk free ${fmtGB(host.disk_free_mb)}`);
  return parts.join(" · ");
}

function fmtGB(mb) {
  if (mb === null || mb === undefined) return "–";
  return mb >= 1024 ? `${(mb / 1024).toFixed(1)} GB` : `${Math.round(mb)} MB`;
}

function heat(v) {
  if (v === null || v === undefined) return "";
  return v >= 90 ? "hot" : v >= 60 ? "warm" : "";
}
