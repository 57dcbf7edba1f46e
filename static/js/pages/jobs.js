// Jobs: a filterable list (state, project, node, text), refreshed when the cluster changes.

import { api, canWrite } from "../api.js";
import { h, replace, fmtAgo, fmtDuration, jobBadge, isStopped, debounce } from "../dom.js";
import { live } from "../live.js";

const STATES = ["QUEUED", "DISPATCHED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"];

export async function render(root, _params, query) {
  let jobs = [];
  const state = h("select", { id: "f-state", "aria-label": "State", onchange: () => load() },
    h("option", { value: "", text: "any state" }), STATES.map((s) => h("option", { value: s, text: s.toLowerCase() })));
  state.value = query.get("state") || "";
  const project = h("select", { id: "f-project", "aria-label": "Project", onchange: () => draw() });
  const node = h("select", { id: "f-node", "aria-label": "Node", onchange: () => draw() });
  const text = h("input", { id: "f-text", type: "search", placeholder: "filter by name, command, id",
    "aria-label": "Filter text", oninput: debounce(() => draw(), 100), value: query.get("q") || "" });
  const body = h("tbody", { id: "jobs-body" });
  const count = h("p", { class: "muted" });
  root.append(
    h("div", { class: "page-head" }, h("h1", { text: "Jobs" }), count,
      canWrite() ? h("a", { class: "button", href: "#/jobs/new", id: "new-job" }, "Submit a job") : null),
    h("div", { class: "filters row" }, state, project, node, text),
    h("div", { class: "scroll-x" }, h("table", { class: "table jobs" },
      h("thead", {}, h("tr", {}, ["Job", "State", "Project", "Node", "GPUs", "Submitted", "Ran for"].map((t) => h("th", { text: t })))),
      body)));

  function options(sel, values, label) {
    const cur = sel.value;
    replace(sel, h("option", { value: "", text: label }), [...values].sort().map((v) => h("option", { value: v, text: v })));
    sel.value = values.has(cur) ? cur : "";
  }

  function draw() {
    options(project, new Set(jobs.map((j) => j.project).filter(Boolean)), "any project");
    options(node, new Set(jobs.map((j) => j.node).filter(Boolean)), "any node");
    const q = text.value.trim().toLowerCase();
    const shown = jobs.filter((j) => (!project.value || j.project === project.value)
      && (!node.value || j.node === node.value)
      && (!q || `#${j.id} ${j.name} ${(j.command || []).join(" ")} ${j.experiment}`.toLowerCase().includes(q)));
    count.textContent = `${shown.length} of ${jobs.length} jobs`;
    replace(body, shown.length ? shown.map((j) => h("tr", { "data-job": j.id },
      h("td", {}, h("a", { href: `#/jobs/${j.id}` }, h("span", { class: "muted", text: `#${j.id} ` }), h("span", { class: "job-name", text: j.name })),
        j.pending_reason ? h("div", { class: "why small", text: j.pending_reason }) : null),
      h("td", {}, jobBadge(j), isStopped(j) ? h("span", { class: "muted small", text: ` ${(j.end || "").replace(/^[^(]*/, "")}` })
        : j.failure_kind ? h("span", { class: "muted small", text: ` ${j.failure_kind}` }) : null),
      h("td", { text: j.experiment ? `${j.project} / ${j.experiment}` : j.project }),
      h("td", { text: j.node || "" }),
      h("td", { class: "num", text: j.cpu_only ? "CPU" : String(j.gpus) }),
      h("td", { text: fmtAgo(j.created_at) }),
      h("td", { text: fmtDuration(j.started_at, j.ended_at) }))) : h("tr", {}, h("td", { colspan: 7, class: "muted", text: jobs.length ? "No job matches these filters." : "No jobs yet." })));
  }

  async function load() {
    const qs = state.value ? `?state=${state.value}&limit=1000` : "?limit=1000";
    jobs = (await api(`/jobs${qs}`)).jobs;
    draw();
  }
  await load();
  // Queue and running set change with every state change: refresh then (at most every 2 s).
  let pending = null;
  const off = live.subscribe("status", () => {
    if (pending) return;
    pending = setTimeout(() => { pending = null; load().catch(() => {}); }, 500);
  });
  return () => { off(); clearTimeout(pending); };
}
