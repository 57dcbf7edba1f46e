// A job: its state and attempts, live logs (follow, pause, search, jump to end), its runs,
// cancel / retry with confirmation.

import { api, canWrite } from "../api.js";
import { h, replace, fmtTime, fmtDuration, stateBadge, jobBadge, isStopped, ansiSegments, plainText, confirmAction, debounce } from "../dom.js";
import { live } from "../live.js";
import { errorBox } from "../app.js";

const MAX_LINES = 5000;
const FINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);

export async function render(root, [id]) {
  const jobId = Number(id);
  let job = await api(`/jobs/${jobId}`);
  const head = h("div", { class: "page-head" });
  const facts = h("dl", { class: "facts" });
  const actions = h("div", { class: "row actions" });
  const msg = h("div", { class: "msg-area", "aria-live": "polite" });
  const attemptsEl = h("div", { id: "attempts" });

  // -- logs ----------------------------------------------------------------------------
  const logEl = h("div", { class: "log", id: "log", role: "log", tabindex: "0", "aria-label": "Job log" });
  const follow = h("input", { type: "checkbox", id: "log-follow", checked: true });
  const pauseBtn = h("button", { class: "secondary", id: "log-pause", "aria-pressed": "false" }, "Pause");
  const search = h("input", { type: "search", id: "log-search", placeholder: "search the log", "aria-label": "Search the log" });
  const found = h("span", { class: "muted small", id: "log-found" });
  const endBtn = h("button", { class: "secondary", id: "log-end" }, "Jump to end");
  const logState = h("span", { class: "muted small", id: "log-state" });
  let paused = false;
  let held = [];          // lines that arrived while paused
  let lineCount = 0;

  function addLines(lines) {
    if (paused) {
      held.push(...lines);
      pauseBtn.textContent = `Resume (${held.length} new)`;
      return;
    }
    const q = search.value.trim().toLowerCase();
    const frag = document.createDocumentFragment();
    for (const line of lines) {
      const row = h("div", { class: "line", "data-id": line.id });
      row.appendChild(h("span", { class: "ln", text: String(line.line_no ?? "") }));
      const text = h("span", { class: "tx" });
      for (const [t, cls] of ansiSegments(line.text || "")) {
        text.appendChild(cls ? h("span", { class: cls, text: t }) : document.createTextNode(t));
      }
      row.appendChild(text);
      if (line.attempt > 1) row.classList.add(`attempt-${line.attempt % 2 ? "odd" : "even"}`);
      if (q && !plainText(line.text || "").toLowerCase().includes(q)) row.hidden = true;
      frag.appendChild(row);
      lineCount++;
    }
    if (lines.length) { const empty = document.getElementById("log-empty"); if (empty) empty.remove(); }
    logEl.appendChild(frag);
    while (lineCount > MAX_LINES) {
      logEl.firstChild.remove();
      lineCount--;
    }
    if (q) countMatches();
    if (follow.checked) logEl.scrollTop = logEl.scrollHeight;
  }

  function countMatches() {
    const q = search.value.trim().toLowerCase();
    let n = 0;
    for (const row of logEl.children) {
      const hit = !q || row.lastChild.textContent.toLowerCase().includes(q);
      row.hidden = !hit;
      if (hit) n++;
    }
    found.textContent = q ? `${n} matching line${n === 1 ? "" : "s"}` : "";
  }

  pauseBtn.addEventListener("click", () => {
    paused = !paused;
    pauseBtn.setAttribute("aria-pressed", String(paused));
    pauseBtn.textContent = paused ? "Resume" : "Pause";
    if (!paused && held.length) {
      const lines = held;
      held = [];
      addLines(lines);
    }
  });
  search.addEventListener("input", debounce(countMatches, 100));
  endBtn.addEventListener("click", () => {
    follow.checked = true;
    logEl.scrollTop = logEl.scrollHeight;
  });
  logEl.addEventListener("scroll", () => {
    // Scrolling up stops following; scrolling back to the bottom resumes it.
    const atEnd = logEl.scrollHeight - logEl.scrollTop - logEl.clientHeight < 8;
    if (follow.checked !== atEnd) follow.checked = atEnd;
  });

  root.append(head, msg, facts, actions,
    h("section", { "aria-labelledby": "h-log" },
      h("div", { class: "row log-bar" }, h("h2", { id: "h-log", text: "Log" }), logState,
        h("label", { class: "check" }, follow, " follow"), pauseBtn, search, found, endBtn),
      logEl),
    h("section", { "aria-labelledby": "h-attempts" }, h("h2", { id: "h-attempts", text: "Attempts and runs" }), attemptsEl));

  function draw() {
    replace(head, h("h1", {}, h("span", { class: "muted", text: `#${job.id} ` }), h("span", { id: "job-name", text: job.name })),
      jobBadge(job), job.cancel_requested && !FINAL.has(job.state) ? h("span", { class: "badge warn", text: "cancelling" }) : null);
    const fact = (k, v) => (v === null || v === undefined || v === "" ? null : [h("dt", { text: k }), h("dd", {}, v)]);
    replace(facts,
      fact("Command", h("code", { text: (job.command || []).join(" ") })),
      fact("Working dir", h("code", { text: job.working_dir })),
      fact("Project", job.experiment ? `${job.project} / ${job.experiment}` : job.project),
      fact("Resources", job.cpu_only ? "CPU only" : `${job.gpus} GPU${job.gpus === 1 ? "" : "s"}${job.gpu_indices ? ` (node ${job.node}, GPU ${job.gpu_indices.join(", ")})` : ""}`),
      fact("Priority", String(job.priority)),
      fact("Attempt", `${job.attempt} of ${job.max_attempts}`),
      fact("Waiting because", job.state === "QUEUED" ? job.pending_reason || "next when a slot frees"
        : job.state === "DISPATCHED" ? job.pending_reason : null),
      fact("Expected start", job.state === "QUEUED" && !job.cpu_only ? (job.expected_start
        ? `${fmtTime(job.expected_start)} (an estimate from the time limits of the jobs before it)`
        : "unknown: a job it waits for has no time limit") : null),
      fact("Slurm job", job.slurm_job_id),
      fact("Stopped", isStopped(job) ? `${job.end}: ${(job.stop_reason || {}).message || ""}` : null),
      fact("Sweep", job.sweep_id ? h("a", { href: `#/sweeps/${job.sweep_id}`, text: `sweep #${job.sweep_id}${job.config && job.config.sweep ? `, trial ${job.config.sweep.trial}` : ""}` }) : null),
      fact("Failure", job.failure_kind && !isStopped(job) ? `${job.failure_kind}${job.exit_code !== null && job.exit_code !== undefined ? ` (exit ${job.exit_code})` : ""}${job.message ? ` — ${job.message}` : ""}` : null),
      fact("Submitted", fmtTime(job.created_at)),
      fact("Ran", job.started_at ? `${fmtTime(job.started_at)} · ${fmtDuration(job.started_at, job.ended_at)}` : null),
      fact("Env", Object.keys(job.env || {}).length ? h("code", { text: Object.entries(job.env).map(([k, v]) => `${k}=${v}`).join(" ") }) : null),
      fact("TensorBoard dir", job.tb_dir), fact("Watching", job.watch_dir));
    replace(actions,
      job.run_id ? h("a", { class: "button secondary", href: `#/runs/${job.run_id}`, id: "open-run" }, "Open its run") : null,
      canWrite() && !FINAL.has(job.state) ? h("button", { class: "danger", id: "cancel", onclick: cancel, disabled: job.cancel_requested }, job.cancel_requested ? "Cancelling…" : "Cancel job") : null,
      canWrite() && (job.state === "FAILED" || job.state === "CANCELLED") ? h("button", { id: "retry", onclick: retry }, "Retry") : null);
    const attempts = job.attempts || [];
    replace(attemptsEl, attempts.length ? h("table", { class: "table" },
      h("thead", {}, h("tr", {}, ["Attempt", "Run", "State", "Node / slots", "Failure", "Started", "Took"].map((t) => h("th", { text: t })))),
      h("tbody", {}, attempts.map((a) => h("tr", {},
        h("td", { class: "num", text: String(a.attempt) }),
        h("td", {}, a.run_id ? h("a", { href: `#/runs/${a.run_id}`, text: `run #${a.run_id}` }) : ""),
        h("td", {}, stateBadge(a.state)),
        h("td", { text: `${a.node || ""}${a.gpu_indices && a.gpu_indices.length ? ` · GPU ${a.gpu_indices.join(", ")}` : ""}${a.slurm_job_id ? ` · Slurm job ${a.slurm_job_id}` : ""}` }),
        h("td", { text: a.failure_kind ? `${a.failure_kind}${a.exit_code !== null && a.exit_code !== undefined ? ` (exit ${a.exit_code})` : ""}${a.attempt === job.attempt && job.message ? ` — ${job.message}` : ""}` : (a.exit_code !== null && a.exit_code !== undefined ? `exit ${a.exit_code}` : "") }),
        h("td", { text: fmtTime(a.started_at) }),
        h("td", { text: fmtDuration(a.started_at, a.ended_at) })))))
      : h("p", { class: "muted", text: job.state === "QUEUED" ? "Not started yet." : "No attempts." }));
    logState.textContent = FINAL.has(job.state) ? `ended (${job.end || job.state.toLowerCase()})` : job.state === "RUNNING" ? "live" : "";
    // An ended job without a line (it never started): say why where the lines would be.
    const empty = document.getElementById("log-empty");
    if (FINAL.has(job.state) && !lineCount && !empty) {
      logEl.appendChild(h("p", { class: "muted", id: "log-empty",
        text: `No log lines: job ${job.end || job.state.toLowerCase()}${job.message ? ` — ${job.message}` : ""}.` }));
    }
  }

  async function cancel() {
    if (!(await confirmAction(`Cancel job #${job.id} (${job.name})? Its processes get SIGTERM, then SIGKILL after 5 s.`, "Cancel job"))) return;
    try {
      job = { ...job, ...(await api(`/jobs/${jobId}/cancel`, { method: "POST" })) };
      draw();
    } catch (e) {
      replace(msg, errorBox(e));
    }
  }

  async function retry() {
    if (!(await confirmAction(`Put job #${job.id} (${job.name}) back in the queue?`, "Retry"))) return;
    try {
      job = { ...job, ...(await api(`/jobs/${jobId}/retry`, { method: "POST" })) };
      draw();
    } catch (e) {
      replace(msg, errorBox(e));
    }
  }

  draw();
  const offJob = live.subscribe(`job:${jobId}`, (j) => {
    if (j) {
      job = j;
      draw();
    }
  });
  const offLogs = live.subscribe(`logs:${jobId}`, (d) => addLines(d.lines));
  return () => { offJob(); offLogs(); };
}
