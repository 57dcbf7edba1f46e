// Sweeps: the list, newest first, with their trials by state.

import { api } from "../api.js";
import { h, replace, fmtAgo, fmtNum, stateBadge } from "../dom.js";
import { live } from "../live.js";

const ORDER = ["PENDING", "QUEUED", "DISPATCHED", "RUNNING", "SUCCEEDED", "EARLY_STOPPED", "STOPPED_ON_EVENT", "FAILED", "CANCELLED"];
const ENDED = ["SUCCEEDED", "EARLY_STOPPED", "STOPPED_ON_EVENT", "FAILED", "CANCELLED"];
const FINAL = new Set(["DONE", "STOPPED", "CANCELLED"]);

function bestText(s) {
  const b = s.best;
  if (!b) return s.best_missing ? `none: ${s.best_missing}` : "";
  const params = Object.entries(b.params || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  return `${FINAL.has(s.state) ? "" : "so far "}trial ${b.trial}: ${fmtNum(b.value)} · ${params}`;
}

export async function render(root) {
  const body = h("tbody", { id: "sweeps-body" });
  root.append(
    h("div", { class: "page-head" }, h("h1", { text: "Sweeps" }),
      h("p", { class: "muted", text: "gpuplane sweep create FILE.toml starts one (docs/sweeps.md)" })),
    h("div", { class: "scroll-x" }, h("table", { class: "table sweeps" },
      h("thead", {}, h("tr", {}, ["Sweep", "State", "Experiment", "Progress", "By state", "Metric", "Best", "Created"].map((t) => h("th", { text: t })))),
      body)));

  async function load() {
    const sweeps = (await api("/sweeps?limit=200")).sweeps;
    replace(body, sweeps.length ? sweeps.map((s) => h("tr", { "data-sweep": s.id },
      h("td", {}, h("a", { href: `#/sweeps/${s.id}` }, h("span", { class: "muted", text: `#${s.id} ` }), h("span", { text: s.name }))),
      h("td", {}, stateBadge(s.state)),
      h("td", { text: s.experiment ? `${s.project} / ${s.experiment}` : s.project }),
      h("td", { class: "num", text: `${ENDED.reduce((n, k) => n + (s.trial_states[k] || 0), 0)} / ${s.trials} ended` }),
      h("td", { class: "small", text: ORDER.filter((k) => s.trial_states[k]).map((k) => `${s.trial_states[k]} ${k.toLowerCase().replaceAll("_", "-")}`).join(", ") }),
      h("td", { text: s.metric || "primary" }),
      h("td", { class: "small", text: bestText(s) }),
      h("td", { text: fmtAgo(s.created_at) }))) : h("tr", {}, h("td", { colspan: 8, class: "muted", text: "No sweeps yet." })));
  }
  await load();
  let pending = null;
  const off = live.subscribe("status", () => {
    if (pending) return;
    pending = setTimeout(() => { pending = null; load().catch(() => {}); }, 1000);
  });
  return () => { off(); clearTimeout(pending); };
}
