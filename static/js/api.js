// The REST client: the token, JSON requests, the caller's identity.

const KEY = "gpuplane.token";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const session = { me: null };

export function token() {
  return localStorage.getItem(KEY);
}

export function setToken(t) {
  localStorage.setItem(KEY, t);
}

export function forgetToken() {
  localStorage.removeItem(KEY);
  session.me = null;
}

export function logout() {
  localStorage.removeItem(KEY);
  session.me = null;
  window.dispatchEvent(new Event("gpuplane:logout"));
}

// `gpuplane up` prints a link with the token in the fragment (#token=...): fragments are
// never sent to the server. Store it once and take it out of the address bar and history.
export function takeTokenFromUrl() {
  const m = location.hash.match(/^#token=([^&]+)/);
  if (!m) return false;
  setToken(decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + location.search + "#/");
  return true;
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = { Authorization: `Bearer ${token() || ""}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(`/api/v1${path}`, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, "Offline", "the server cannot be reached; retrying when it is back");
  }
  let data = null;
  const text = await resp.text();
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!resp.ok) {
    const err = (data && data.error) || {};
    if (resp.status === 401 && path !== "/auth/whoami") logout();
    throw new ApiError(resp.status, err.code || `HTTP${resp.status}`,
      err.message || `the server answered ${resp.status}`);
  }
  return data;
}

// Features that other parts of the server add over time: the server's route map
// (GET /api/v1/routes) says which exist, so a missing one is a calm notice, not a 404.
let routeMap = null;

async function routes() {
  if (!routeMap) {
    routeMap = api("/routes").then((d) => d.routes.map((r) => ({
      methods: r.methods,
      re: new RegExp(`^${r.rule.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")
        .replace(/<path:[^>]+>/g, ".+").replace(/<int:[^>]+>/g, "\\d+").replace(/<[^>]+>/g, "[^/]+")}$`),
    }))).catch((e) => { routeMap = null; throw e; });
  }
  return routeMap;
}

export async function hasRoute(path, method = "GET") {
  const full = `/api/v1${path.split("?")[0]}`;
  return (await routes()).some((r) => r.methods.includes(method) && r.re.test(full));
}

// GET that answers null when this server does not have the route.
export async function optional(path) {
  if (!(await hasRoute(path))) return null;
  return api(path);
}

export async function whoami() {
  session.me = await api("/auth/whoami");
  document.body.classList.toggle("can-write", !!session.me.can_write);
  return session.me;
}

export function canWrite() {
  return !!(session.me && session.me.can_write);
}
