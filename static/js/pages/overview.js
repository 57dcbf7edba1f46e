// Overview: nodes and their GPUs (live readings, which job holds each slot), the queue in
// order with why each job waits, running jobs, recent events.

import { h, replace, fmtAgo, fmtNum, stateBadge } from "../dom.js";
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
  replace(nodesEl, s.nodes.length ? s.nodes.map((n) => nodeCard(n, names))
    : h("div", { class: "notice" }, "No node has connected yet. Start an agent on a GPU host: ",
      h("code", { text: "gpuplane-agent --server URL --token TOKEN" }), " (or ",
      h("code", { text: "--fake-gpus 2" }), " to try it without GPUs)."));
  replace(queueEl, s.queue.length ? s.queue.map((j, i) => h("li", {},
    h("a", { href: `#/jobs/${j.id}` }, `#${j.id} `, h("span", { text: j.name })),
    h("span", { class: "muted" }, ` · ${j.cpu_only ? "CPU" : `${j.gpus} GPU${j.gpus === 1 ? "" : "s"}`} · priority ${j.priority}`),
    h("div", { class: "why", text: j.pending_reason || (i === 0 ? "next when a slot frees" : `behind ${i} job${i === 1 ? "" : "s"}`) })))
    : h("li", { class: "muted", text: "Nothing is waiting." }));
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

function bar(frac, label, cls = "") {
  const pct = Math.max(0, Math.min(100, (frac || 0) * 100));
  const fill = h("span", { class: `fill ${cls}` });
  fill.style.width = `${pct}%`;
  return h("span", { class: "bar", role: "img", "aria-label": label, title: label }, fill);
}

function nodeCard(n, names) {
  const host = n.host || {};
  const connected = n.state === "connected";
  return h("article", { class: `card node ${connected ? "" : "down"}`, "data-node": n.name },
    h("header", { class: "row" },
      h("h3", { text: n.name }),
      h("span", { class: `badge ${connected ? "ok" : "warn"}`, text: n.state }),
      n.fake ? h("span", { class: "badge muted", text: "fake GPUs" }) : null,
      h("span", { class: "muted grow right", text: connected ? hostLine(host) : `last seen ${fmtAgo(n.last_seen)}` })),
    n.gpus.length ? h("table", { class: "table gpus" },
      h("thead", {}, h("tr", {}, ["GPU", "Utilisation", "Memory", "Temp", "Power", "Job"].map((t) => h("th", { text: t })))),
      h("tbody", {}, n.gpus.map((g) => {
        const memFrac = g.memory_total_mb ? (g.mem_used_mb || 0) / g.memory_total_mb : 0;
        return h("tr", { "data-gpu": g.index },
          h("td", {}, h("span", { text: `${g.index}` }), h("span", { class: "muted small", text: ` ${g.name || ""}` })),
          h("td", {}, h("div", { class: "meter" }, bar((g.util || 0) / 100, `utilisation ${g.util ?? "?"} %`, heat(g.util)),
            h("span", { class: "num", text: g.util === null || g.util === undefined ? "–" : `${Math.round(g.util)} %` }))),
          h("td", {}, h("div", { class: "meter" }, bar(memFrac, `memory ${g.mem_used_mb ?? "?"} of ${g.memory_total_mb} MB`, heat(memFrac * 100)),
            h("span", { class: "num", text: `${fmtGB(g.mem_used_mb)} / ${fmtGB(g.memory_total_mb)}` }))),
          h("td", { class: "num", text: g.temp_c === null || g.temp_c === undefined ? "–" : `${Math.round(g.temp_c)} °C` }),
          h("td", { class: "num", text: g.power_w === null || g.power_w === undefined ? "–" : `${Math.round(g.power_w)} W` }),
          h("td", {}, g.job_id ? h("a", { href: `#/jobs/${g.job_id}` }, `#${g.job_id} `, h("span", { text: names.get(g.job_id) || "" }))
            : h("span", { class: "muted", text: "free" })));
      }))) : null,
    n.cpu_jobs && n.cpu_jobs.length ? h("p", { class: "small" }, "CPU jobs: ",
      n.cpu_jobs.map((id) => h("a", { href: `#/jobs/${id}`, class: "chip" }, `#${id} `, h("span", { text: names.get(id) || "" })))) : null);
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
