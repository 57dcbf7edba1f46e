// The shell: login, the header (who, live state), and a hash router over the pages.

import { forgetToken, logout, session, setToken, takeTokenFromUrl, token, whoami } from "./api.js";
import { h, replace, $ } from "./dom.js";
import { live } from "./live.js";

const ROUTES = [
  [/^#?\/?$/, "overview"],
  [/^#\/jobs\/new$/, "submit"],
  [/^#\/jobs\/(\d+)$/, "job"],
  [/^#\/jobs$/, "jobs"],
  [/^#\/runs\/(\d+)$/, "run"],
  [/^#\/runs$/, "runs"],
  [/^#\/experiments$/, "experiments"],
  [/^#\/sweeps\/(\d+)$/, "sweep"],
  [/^#\/sweeps$/, "sweeps"],
  [/^#\/events$/, "events"],
  [/^#\/metrics$/, "metricdefs"],
  [/^#\/login$/, "login"],
];

let cleanup = null;
let renderSeq = 0;

// For tests and benchmarks: the page's live objects (charts register here).
window.gpuplane = { live, charts: {}, session };

function route() {
  const hash = location.hash.split("?")[0];
  for (const [re, name] of ROUTES) {
    const m = hash.match(re);
    if (m) return { name, params: m.slice(1), query: new URLSearchParams(location.hash.split("?")[1] || "") };
  }
  return { name: "notfound", params: [], query: new URLSearchParams() };
}

async function render() {
  const seq = ++renderSeq;
  if (cleanup) {
    try { cleanup(); } catch (e) { console.warn(e); }
    cleanup = null;
  }
  window.gpuplane.charts = {};
  const main = $("#main");
  const r = route();
  if (!token() || !session.me) {
    if (!(await ensureLogin())) return showLogin();
    if (seq !== renderSeq) return;
  }
  markNav(r.name);
  if (r.name === "login") return showLogin();
  if (r.name === "notfound") {
    replace(main, h("section", { class: "empty" }, h("h1", { text: "Nothing here" }),
      h("p", {}, "This address is not a page of the dashboard. ", h("a", { href: "#/", text: "Go to the overview" }))));
    return;
  }
  replace(main, h("p", { class: "muted loading", text: "Loading…" }));
  try {
    const mod = await import(`./pages/${r.name}.js`);
    if (seq !== renderSeq) return;
    const root = h("div", { class: `page page-${r.name}` });
    replace(main, root);
    cleanup = (await mod.render(root, r.params, r.query)) || null;
    if (seq !== renderSeq && cleanup) cleanup();
  } catch (e) {
    if (seq !== renderSeq) return;
    replace(main, errorBox(e));
  }
}

export function errorBox(e) {
  return h("div", { class: "notice error", role: "alert" },
    h("strong", { text: e.status ? `${e.code}: ` : "Error: " }), e.message || String(e));
}

function markNav(name) {
  const active = { overview: "#/", jobs: "#/jobs", job: "#/jobs", submit: "#/jobs", runs: "#/runs",
    run: "#/runs", experiments: "#/experiments", sweeps: "#/sweeps", sweep: "#/sweeps", events: "#/events", metricdefs: "#/metrics" }[name];
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.getAttribute("href") === active) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

async function ensureLogin() {
  if (!token()) return false;
  try {
    await whoami();
    showWho();
    return true;
  } catch (e) {
    if (e.status === 401) {
      logout();
      return false;
    }
    throw e;
  }
}

function showWho() {
  const me = session.me;
  replace($("#who"),
    h("span", { class: "who-name", text: me.name }),
    h("span", { class: `badge scope-${me.scope}`, text: me.can_write ? `${me.scope} · can write` : `${me.scope} · read only` }),
    h("button", { class: "link", id: "logout", onclick: () => { logout(); location.hash = "#/login"; } }, "Log out"));
}

function showLogin(message) {
  live.stop();
  replace($("#who"));
  document.body.classList.remove("can-write");
  const input = h("input", { id: "token", type: "password", autocomplete: "off", required: true,
    placeholder: "paste a token", "aria-label": "Token", spellcheck: "false" });
  const err = h("p", { class: "error-text", role: "alert" });
  const form = h("form", {
    class: "card login", onsubmit: async (ev) => {
      ev.preventDefault();
      setToken(input.value.trim());
      try {
        await whoami();
      } catch (e) {
        forgetToken();
        err.textContent = e.status === 401
          ? "This token is unknown or revoked. Copy it again from `gpuplane token show-admin` or ask for a new one."
          : e.message;
        return;
      }
      showWho();
      if (location.hash === "#/login") location.hash = "#/";
      else render();
    },
  },
  h("h1", { text: "Log in to GPUPlane" }),
  h("p", { class: "muted" }, "Paste a token, or open the link ", h("code", { text: "gpuplane up" }),
    " prints. The admin token is in ", h("code", { text: "~/.gpuctl/server.toml" }),
    "; ", h("code", { text: "gpuplane token create --scope read" }), " makes a read-only one."),
  h("label", { for: "token", text: "Token" }), input,
  message ? h("p", { class: "muted", text: message }) : null,
  err,
  h("button", { type: "submit", id: "login" }, "Log in"));
  replace($("#main"), form);
  input.focus();
}

live.onstate = (state, secs) => {
  const el = $("#live");
  el.className = `live live-${state}`;
  el.textContent = state === "live" ? "live" : state === "reconnecting" ? `reconnecting in ${secs} s` : "";
};

window.addEventListener("gpuplane:logout", () => {
  live.stop();
  if (location.hash !== "#/login") location.hash = "#/login";
  else showLogin();
});
window.addEventListener("hashchange", () => {
  if (takeTokenFromUrl()) session.me = null;
  render();
});
takeTokenFromUrl();
render();
