// Runs: every run (job attempts, SDK runs, imports), filterable.

import { api } from "../api.js";
import { h, replace, fmtAgo, fmtDuration, stateBadge, debounce } from "../dom.js";

export async function render(root, _params, query) {
  const runs = (await api("/runs?limit=1000")).runs;
  const project = h("select", { id: "r-project", "aria-label": "Project", onchange: () => draw() },
    h("option", { value: "", text: "any project" }),
    [...new Set(runs.map((r) => r.project))].sort().map((p) => h("option", { value: p, text: p })));
  project.value = query.get("project") || "";
  const text = h("input", { id: "r-text", type: "search", placeholder: "filter by name, experiment, node, id",
    "aria-label": "Filter text", oninput: debounce(() => draw(), 100) });
  const body = h("tbody", {});
  const count = h("p", { class: "muted" });
  root.append(h("div", { class: "page-head" }, h("h1", { text: "Runs" }), count),
    h("div", { class: "filters row" }, project, text),
    h("div", { class: "scroll-x" }, h("table", { class: "table" },
      h("thead", {}, h("tr", {}, ["Run", "State", "Project / experiment", "Job", "Source", "Node", "Started", "Took"].map((t) => h("th", { text: t })))),
      body)));
  function draw() {
    const q = text.value.trim().toLowerCase();
    const shown = runs.filter((r) => (!project.value || r.project === project.value)
      && (!q || `#${r.id} ${r.name} ${r.experiment} ${r.node}`.toLowerCase().includes(q)));
    count.textContent = `${shown.length} of ${runs.length} runs`;
    replace(body, shown.length ? shown.map((r) => h("tr", {},
      h("td", {}, h("a", { href: `#/runs/${r.id}` }, h("span", { class: "muted", text: `#${r.id} ` }), h("span", { text: r.name || "" }))),
      h("td", {}, stateBadge(r.state)),
      h("td", { text: r.experiment ? `${r.project} / ${r.experiment}` : r.project }),
      h("td", {}, r.job_id ? h("a", { href: `#/jobs/${r.job_id}`, text: `#${r.job_id}` }) : ""),
      h("td", { text: r.kind === "EVALUATE" ? `evaluation of checkpoint ${r.parent_checkpoint_id}` : r.source }),
      h("td", { text: r.node || "" }),
      h("td", { text: fmtAgo(r.started_at || r.created_at) }),
      h("td", { text: fmtDuration(r.started_at, r.ended_at) })))
      : h("tr", {}, h("td", { colspan: 8, class: "muted", text: runs.length ? "No run matches." : "No runs yet." })));
  }
  draw();
}
