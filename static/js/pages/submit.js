// Submit a job: the same fields as `gpuplane job submit`.

import { api, canWrite } from "../api.js";
import { h, replace } from "../dom.js";
import { errorBox } from "../app.js";

// Split a command line like a POSIX shell does for plain words and quotes (no expansion).
export function splitArgs(s) {
  const out = [];
  let cur = "", inWord = false, quote = null;
  for (let i = 0; i < s.length; i++) {
    const c = s[i];
    if (quote) {
      if (c === quote) quote = null;
      else if (c === "\\" && quote === '"' && i + 1 < s.length) cur += s[++i];
      else cur += c;
    } else if (c === "'" || c === '"') {
      quote = c;
      inWord = true;
    } else if (c === "\\" && i + 1 < s.length) {
      cur += s[++i];
      inWord = true;
    } else if (/\s/.test(c)) {
      if (inWord) out.push(cur);
      cur = "";
      inWord = false;
    } else {
      cur += c;
      inWord = true;
    }
  }
  if (quote) throw new Error("the command has an unclosed quote");
  if (inWord) out.push(cur);
  return out;
}

export function render(root) {
  if (!canWrite()) {
    root.append(h("div", { class: "notice" }, "This token can only read. Submitting needs a write token (",
      h("code", { text: "gpuplane token create --scope write" }), ")."));
    return;
  }
  const field = (label, input, hint) => h("div", { class: "field" },
    h("label", { for: input.id, text: label }), input, hint ? h("small", { class: "muted", text: hint }) : null);
  const inp = (id, attrs = {}) => h("input", { id, name: id, ...attrs });
  const name = inp("name", { placeholder: "mnist" });
  const command = inp("command", { required: true, placeholder: "python train.py --epochs 3", spellcheck: "false" });
  const workdir = inp("working_dir", { required: true, placeholder: "/home/me/mnist", spellcheck: "false" });
  const gpus = inp("gpus", { type: "number", min: 0, max: 64, value: "1" });
  const cpu = inp("cpu_only", { type: "checkbox" });
  const priority = inp("priority", { type: "number", min: -1000, max: 1000, value: "0" });
  const attempts = inp("max_attempts", { type: "number", min: 1, max: 100, value: "3" });
  const project = inp("project", { placeholder: "default" });
  const experiment = inp("experiment", { placeholder: "lr-sweep" });
  const env = h("textarea", { id: "env", name: "env", rows: 3, placeholder: "LR=0.1\nSEED=1", spellcheck: "false" });
  const tb = inp("tb_dir", { placeholder: "runs (relative to the working dir)", spellcheck: "false" });
  const watch = inp("watch_dir", { placeholder: "checkpoints", spellcheck: "false" });
  const shell = inp("shell", { type: "checkbox" });
  const err = h("div", { class: "msg-area", "aria-live": "polite" });
  cpu.addEventListener("change", () => { gpus.disabled = cpu.checked; });

  const form = h("form", { class: "card form", id: "submit-form", onsubmit: async (ev) => {
    ev.preventDefault();
    replace(err);
    let body;
    try {
      body = {
        name: name.value.trim(),
        command: shell.checked ? command.value : splitArgs(command.value),
        working_dir: workdir.value.trim(),
        priority: Number(priority.value || 0),
        max_attempts: Number(attempts.value || 3),
        project: project.value.trim() || "default",
        experiment: experiment.value.trim(),
        env: parseEnv(env.value),
        tb_dir: tb.value.trim() || null,
        watch_dir: watch.value.trim() || null,
      };
      if (cpu.checked) body.cpu_only = true;
      else body.gpus = Number(gpus.value || 0);
    } catch (e) {
      replace(err, errorBox(e));
      return;
    }
    try {
      const job = await api("/jobs", { method: "POST", body });
      location.hash = `#/jobs/${job.id}`;
    } catch (e) {
      replace(err, errorBox(e));
    }
  } },
  h("p", { class: "muted" }, "The same fields as ", h("code", { text: "gpuplane job submit" }),
    ". The working dir is a path on the agent's host and is used as written."),
  field("Name", name),
  field("Command", command, "split into arguments like a shell (quotes work); tick “shell” to run it through /bin/sh -c"),
  h("label", { class: "check" }, shell, " run through a shell"),
  field("Working dir", workdir, "absolute path on the GPU host"),
  h("div", { class: "row wrap" },
    field("GPUs", gpus), h("label", { class: "check" }, cpu, " CPU only"),
    field("Priority", priority, "higher runs first"), field("Max attempts", attempts)),
  h("div", { class: "row wrap" }, field("Project", project), field("Experiment", experiment)),
  field("Environment", env, "one NAME=value per line"),
  h("div", { class: "row wrap" }, field("TensorBoard dir", tb), field("Watch checkpoints in", watch)),
  err,
  h("div", { class: "row" }, h("button", { type: "submit", id: "submit" }, "Submit job"),
    h("a", { href: "#/jobs", class: "button secondary", text: "Back to jobs" })));
  root.append(h("div", { class: "page-head" }, h("h1", { text: "Submit a job" })), form);
  name.focus();
}

function parseEnv(text) {
  const env = {};
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const i = line.indexOf("=");
    if (i <= 0) throw new Error(`environment line "${line}" is not NAME=value`);
    env[line.slice(0, i).trim()] = line.slice(i + 1);
  }
  return env;
}
