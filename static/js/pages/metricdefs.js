// Metric definitions: direction and primary flag at global, project and experiment scope
// (issue 11's routes; a calm notice when this server does not have them yet).

import { api, optional, canWrite } from "../api.js";
import { h, replace } from "../dom.js";
import { errorBox } from "../app.js";

export async function render(root) {
  root.append(h("div", { class: "page-head" }, h("h1", { text: "Metric definitions" })),
    h("p", { class: "muted" }, "Which way each metric wins (lower or higher) and which one decides: resolved experiment → project → global. Without a definition the name decides (loss, error → lower; acc, f1, reward → higher)."));
  const body = h("div", { id: "defs" });
  const msg = h("div", { class: "msg-area", "aria-live": "polite" });
  root.append(msg, body);
  async function load() {
    const data = await optional("/metric-definitions");
    if (!data) {
      replace(body, h("p", { class: "muted not-available", text: "Metric definitions are not available on this server yet." }));
      return;
    }
    const defs = data.definitions || data.metric_definitions || [];
    replace(body, h("table", { class: "table" },
      h("thead", {}, h("tr", {}, ["Metric", "Scope", "Direction", "Primary", ""].map((t) => h("th", { text: t })))),
      h("tbody", {}, defs.length ? defs.map((d) => row(d)) : h("tr", {}, h("td", { colspan: 5, class: "muted", text: "No definitions yet: names decide." })))),
    canWrite() ? editor() : null);
  }
  function scopeOf(d) {
    return d.experiment ? `experiment ${d.project} / ${d.experiment}` : d.project ? `project ${d.project}` : "global";
  }
  function row(d) {
    return h("tr", {}, h("td", {}, h("code", { text: d.key })), h("td", { text: scopeOf(d) }),
      h("td", { text: d.direction === "max" ? "↑ higher is better" : d.direction === "min" ? "↓ lower is better" : "inherited, else by its name" }),
      h("td", { text: d.primary ? "primary" : "" }), h("td"));
  }
  function editor() {
    const key = h("input", { id: "md-key", required: true, placeholder: "val/loss", "aria-label": "Metric key" });
    const dir = h("select", { id: "md-direction", "aria-label": "Direction" }, h("option", { value: "min", text: "lower is better" }), h("option", { value: "max", text: "higher is better" }));
    const primary = h("input", { type: "checkbox", id: "md-primary" });
    const project = h("input", { id: "md-project", placeholder: "project (empty: global)", "aria-label": "Project" });
    const experiment = h("input", { id: "md-experiment", placeholder: "experiment (optional)", "aria-label": "Experiment" });
    return h("form", { class: "card form", onsubmit: async (ev) => {
      ev.preventDefault();
      replace(msg);
      try {
        await api("/metric-definitions", { method: "POST", body: { key: key.value.trim(), direction: dir.value, primary: primary.checked,
          project: project.value.trim(), experiment: experiment.value.trim() } });
        await load();
      } catch (e) {
        replace(msg, errorBox(e));
      }
    } }, h("h2", { text: "Set a definition" }),
    h("div", { class: "row wrap" }, key, dir, h("label", { class: "check" }, primary, " primary"), project, experiment,
      h("button", { type: "submit", id: "md-save" }, "Save")));
  }
  await load();
}
