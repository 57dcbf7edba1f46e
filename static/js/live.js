// ONE server-sent-event stream per tab carrying every topic the page shows
// (GET /api/v1/stream?topics=...). Read with fetch so the token goes in a header, not the
// URL. Cursors of log and event topics are kept here and named again on reconnect, so a
// server restart or a dropped connection loses nothing and needs no reload. A 503 (the
// server's stream cap) or a network error backs off: 1 s, 2 s, 4 s ... up to 30 s.

import { token, logout } from "./api.js";

const MAX_BACKOFF_MS = 30000;

class Live {
  constructor() {
    this.topics = new Map();     // topic -> {handlers: Set, cursor}
    this.ctrl = null;
    this.backoff = 1000;
    this.timer = null;
    this.state = "idle";
    this.onstate = () => {};
    this.connections = 0;        // how many streams this tab opened (for tests and figures)
  }

  // Subscribe fn(data) to a topic; returns the function that unsubscribes.
  subscribe(topic, fn) {
    let t = this.topics.get(topic);
    const isNew = !t;
    if (!t) {
      t = { handlers: new Set(), cursor: null };
      this.topics.set(topic, t);
    }
    t.handlers.add(fn);
    if (isNew) this._reconnectSoon(0);
    return () => {
      t.handlers.delete(fn);
      if (!t.handlers.size) {
        this.topics.delete(topic);
        this._reconnectSoon(50);
      }
    };
  }

  _setState(s, detail) {
    this.state = s;
    this.onstate(s, detail);
  }

  _reconnectSoon(ms) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this._connect(), ms);
  }

  stop() {
    clearTimeout(this.timer);
    if (this.ctrl) this.ctrl.abort();
    this.ctrl = null;
    this._setState("idle");
  }

  _query() {
    const parts = [];
    for (const [topic, t] of this.topics) {
      parts.push(t.cursor === null ? topic : `${topic}@${t.cursor}`);
    }
    return parts.join(",");
  }

  async _connect() {
    if (this.ctrl) this.ctrl.abort();
    this.ctrl = null;
    if (!this.topics.size || !token()) {
      this._setState("idle");
      return;
    }
    const ctrl = new AbortController();
    this.ctrl = ctrl;
    let resp;
    try {
      this.connections++;
      resp = await fetch(`/api/v1/stream?topics=${encodeURIComponent(this._query())}`, {
        headers: { Authorization: `Bearer ${token()}`, Accept: "text/event-stream" },
        signal: ctrl.signal, cache: "no-store",
      });
    } catch (e) {
      if (ctrl.signal.aborted) return;
      return this._retry();
    }
    if (resp.status === 401) {
      logout();
      return;
    }
    if (!resp.ok || !resp.body) {
      const after = Number(resp.headers.get("Retry-After")) * 1000;
      try { await resp.body?.cancel(); } catch { /* gone already */ }
      return this._retry(resp.status === 503 ? after : 0);
    }
    this.backoff = 1000;
    this._setState("live");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, i);
          buf = buf.slice(i + 2);
          this._dispatch(block);
        }
      }
    } catch (e) {
      if (ctrl.signal.aborted) return;
    }
    if (ctrl.signal.aborted || this.ctrl !== ctrl) return;
    this._retry();              // the server closed the stream (restart, shutdown)
  }

  _retry(minMs = 0) {
    const wait = Math.max(minMs || 0, this.backoff) * (0.8 + Math.random() * 0.4);
    this.backoff = Math.min(this.backoff * 2, MAX_BACKOFF_MS);
    this._setState("reconnecting", Math.round(wait / 1000));
    this._reconnectSoon(wait);
  }

  _dispatch(block) {
    const data = block.split("\n").filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
    if (!data) return;        // a comment (keepalive)
    let msg;
    try {
      msg = JSON.parse(data);
    } catch {
      return;
    }
    const t = this.topics.get(msg.topic);
    if (!t) return;
    const d = msg.data;
    if (d && d.lines && d.lines.length) t.cursor = d.lines[d.lines.length - 1].id;
    if (d && d.events && d.events.length) t.cursor = d.events[d.events.length - 1].id;
    for (const fn of t.handlers) {
      try {
        fn(d);
      } catch (e) {
        console.warn("live handler failed", e);
      }
    }
  }
}

export const live = new Live();
