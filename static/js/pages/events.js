// Events: a live feed of lifecycle events and rule findings, with filters.

import { h, replace, fmtTime, debounce } from "../dom.js";
import { live } from "../live.js";

const MAX_KEPT = 2000;

export function eventRow(e) {
  return h("li", { class: `event sev-${e.severity || "info"}`, "data-type": e.type },
    h("span", { class: "sev", text: e.severity || "info" }),
    h("time", { class: "muted", text: fmtTime(e.ts) }),
    h("strong", { class: "type", text: e.type }),
    h("span", { class: "msg", text: e.message || "" }),
    h("span", { class: "refs" },
      e.job_id ? h("a", { href: `#/jobs/${e.job_id}`, text: `job #${e.job_id}` }) : null,
      e.run_id ? h("a", { href: `#/runs/${e.run_id}`, text: `run #${e.run_id}` }) : null,
      e.node ? h("span", { class: "muted", text: e.node }) : null));
}

export function render(root, _params, query) {
  const all = [];
  const sev = h("select", { id: "ev-severity", "aria-label": "Minimum severity", onchange: () => draw() },
    h("option", { value: "", text: "any severity" }),
    h("option", { value: "warning", text: "warning and worse" }),
    h("option", { value: "critical", text: "critical" }));
  const type = h("select", { id: "ev-type", "aria-label": "Type", onchange: () => draw() },
    h("option", { value: "", text: "any type" }));
  const text = h("input", { id: "ev-text", type: "search", placeholder: "filter text, job, run, node",
    "aria-label": "Filter", oninput: debounce(() => draw(), 120), value: query.get("q") || "" });
  const list = h("ul", { class: "events", id: "events" });
  const count = h("p", { class: "muted" });
  root.append(h("div", { class: "page-head" }, h("h1", { text: "Events" }), count),
    h("div", { class: "filters row" }, sev, type, text), list);

  const rank = { info: 0, warning: 1, critical: 2 };
  function draw() {
    const minSev = rank[sev.value] || 0;
    const q = text.value.trim().toLowerCase();
    const types = new Set(all.map((e) => e.type));
    if (types.size !== type.options.length - 1) {
      const cur = type.value;
      replace(type, h("option", { value: "", text: "any type" }),
        [...types].sort().map((t) => h("option", { value: t, text: t })));
      type.value = cur;
    }
    const shown = all.filter((e) => (rank[e.severity] || 0) >= minSev
      && (!type.value || e.type === type.value)
      && (!q || `${e.type} ${e.message} job #${e.job_id} run #${e.run_id} ${e.node}`.toLowerCase().includes(q)))
      .slice(-500).reverse();
    count.textContent = `${shown.length} of ${all.length} events`;
    replace(list, shown.length ? shown.map(eventRow) : h("li", { class: "muted", text: "No events match." }));
  }
  draw();
  return live.subscribe("events", (d) => {
    all.push(...d.events);
    if (all.length > MAX_KEPT) all.splice(0, all.length - MAX_KEPT);
    draw();
  });
}
