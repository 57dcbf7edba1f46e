// DOM helpers. Every piece of text from the server goes in through text nodes
// (textContent): nothing a job, a log line or a metric name holds is ever parsed as HTML.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  if (attrs) {
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "value") el.value = v;
      else if (k === "checked") el.checked = !!v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else if (c instanceof Node) el.appendChild(c);
    else el.appendChild(document.createTextNode(String(c)));
  }
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  clear(el);
  append(el, children);
  return el;
}

export const $ = (sel, root = document) => root.querySelector(sel);

// -- formatting --------------------------------------------------------------------

export function fmtTime(ms) {
  if (!ms) return "";
  const d = new Date(ms);
  const today = new Date();
  const pad = (n) => String(n).padStart(2, "0");
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  if (d.toDateString() === today.toDateString()) return hms;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${hms}`;
}

export function fmtAgo(ms) {
  if (!ms) return "";
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function fmtDuration(startMs, endMs) {
  if (!startMs) return "";
  let s = Math.max(0, Math.round(((endMs || Date.now()) - startMs) / 1000));
  const hh = Math.floor(s / 3600), mm = Math.floor((s % 3600) / 60);
  s %= 60;
  if (hh) return `${hh} h ${mm} min`;
  if (mm) return `${mm} min ${s} s`;
  return `${s} s`;
}

export function fmtNum(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "string") return v;          // "NaN", "Infinity"
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
  return String(Number(v.toPrecision(5)));
}

export function stateBadge(state) {
  return h("span", { class: `badge s-${String(state || "").toLowerCase()}`, text: state || "" });
}

// A job's end as the server words it (gpuplane/states.py end_label): an early stop or a
// stop on an event is an end of its own, not a cancel.
const STOPS = { EARLY_STOPPED: "EARLY-STOPPED", STOPPED_ON_EVENT: "STOPPED ON EVENT" };
export function isStopped(job) {
  return job.state === "CANCELLED" && Object.hasOwn(STOPS, job.failure_kind || "");
}
export function jobBadge(job) {
  if (!isStopped(job)) return stateBadge(job.state);
  return h("span", { class: "badge s-stopped", text: STOPS[job.failure_kind], title: job.end || "" });
}

// -- terminal text ------------------------------------------------------------------

const SGR_COLOURS = {
  30: "black", 31: "red", 32: "green", 33: "yellow", 34: "blue", 35: "magenta", 36: "cyan",
  37: "white", 90: "grey", 91: "red", 92: "green", 93: "yellow", 94: "blue", 95: "magenta",
  96: "cyan", 97: "white",
};
// CSI sequences, OSC strings (terminated by BEL or ST), other two-byte escapes.
const ESCAPES = /\x1b\[([0-9;?]*)[ -\/]*([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]?/g;
const CONTROLS = /[\x00-\x08\x0b-\x1f\x7f]/g;

// A log line as [text, className] segments: SGR colours and bold become classes, every
// other escape and control character is dropped. The text is set with textContent.
export function ansiSegments(line) {
  const out = [];
  let cls = { fg: null, bold: false };
  let last = 0;
  const push = (text) => {
    text = text.replace(CONTROLS, "");
    if (!text) return;
    const c = [cls.fg ? `c-${cls.fg}` : "", cls.bold ? "c-bold" : ""].filter(Boolean).join(" ");
    out.push([text, c]);
  };
  ESCAPES.lastIndex = 0;
  let m;
  while ((m = ESCAPES.exec(line)) !== null) {
    push(line.slice(last, m.index));
    last = ESCAPES.lastIndex;
    if (m[2] === "m") {
      const codes = (m[1] || "0").split(";").map((x) => parseInt(x || "0", 10));
      for (const code of codes) {
        if (code === 0) cls = { fg: null, bold: false };
        else if (code === 1) cls = { ...cls, bold: true };
        else if (code === 22) cls = { ...cls, bold: false };
        else if (code === 39) cls = { ...cls, fg: null };
        else if (SGR_COLOURS[code]) cls = { ...cls, fg: SGR_COLOURS[code] };
      }
    }
    if (m[0] === "") ESCAPES.lastIndex++;
  }
  push(line.slice(last));
  return out;
}

export function plainText(line) {
  return ansiSegments(line).map((s) => s[0]).join("");
}

// -- confirmation -------------------------------------------------------------------

// An in-page dialog (not window.confirm): calm, styled, and keyboard-reachable.
export function confirmAction(message, yesLabel = "Yes") {
  const dlg = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = message;
  document.getElementById("confirm-yes").textContent = yesLabel;
  dlg.returnValue = "";
  return new Promise((resolve) => {
    dlg.addEventListener("close", () => resolve(dlg.returnValue === "yes"), { once: true });
    dlg.showModal();
  });
}

export function debounce(fn, ms) {
  let t = null;
  return (...args) => {
    clearTimeout(t);
    t = setTimeout(() => fn(...args), ms);
  };
}
