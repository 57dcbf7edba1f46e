// Sweeps: the list, newest first, with their trials by state.

import { api } from "../api.js";
import { h, replace, fmtAgo, stateBadge } from "../dom.js";
import { live } from "../live.js";

const ORDER = ["PENDING", "QUEUED", "DISPATCHED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"];

export async function render(root) {
  const body = h("tbody", { id: "sweeps-body" });
  root.append(
    h("div", { class: "page-head" }, h("h1", { text: "Sweeps" }),
      h("p", { class: "muted", text: "gpuplane sweep create FILE.toml starts one (docs/sweeps.md)" })),
    h("div", { class: "scroll-x" }, h("table", { class: "table sweeps" },
      h("thead", {}, h("tr", {}, ["Sweep", "State", "Experiment", "Trials", "By state", "Metric", "Created"].map((t) => h("th", { text: t })))),
      body)));

  async function load() {
    const sweeps = (await api("/sweeps?limit=200")).sweeps;
    replace(body, sweeps.length ? sweeps.map((s) => h("tr", { "data-sweep": s.id },
      h("td", {}, h("a", { href: `#/sweeps/${s.id}` }, h("span", { class: "muted", text: `#${s.id} ` }), h("span", { text: s.name }))),
      h("td", {}, stateBadge(s.state)),
      h("td", { text: s.experiment ? `${s.project} / ${s.experiment}` : s.project }),
      h("td", { class: "num", text: String(s.trials) }),
      h("td", { class: "small", text: ORDER.filter((k) => s.trial_states[k]).map((k) => `${s.trial_states[k]} ${k.toLowerCase()}`).join(", ") }),
      h("td", { text: s.metric || "primary" }),
      h("td", { text: fmtAgo(s.created_at) }))) : h("tr", {}, h("td", { colspan: 7, class: "muted", text: "No sweeps yet." })));
  }
  await load();
  let pending = null;
  const off = live.subscribe("status", () => {
    if (pending) return;
    pending = setTimeout(() => { pending = null; load().catch(() => {}); }, 1000);
  });
  return () => { off(); clearTimeout(pending); };
}
