"""Webhooks: events pushed to phones (ntfy, Bark) and to any JSON endpoint.

`[[webhooks]]` in server.toml (docs/events.md). A dispatcher thread tails the events table
(whoever wrote the event: the engine, the lifecycle, the SDK) and puts each matching event
on the bounded queue of each webhook; one sender thread per webhook posts them in order
with a timeout and retries with backoff. Nothing here runs on a request or ingest thread,
so a slow, refusing or dead receiver only delays its own queue; when that queue is full
the oldest waiting event is dropped, with a log line.
"""
import logging
import threading
import urllib.parse
from collections import deque

import requests

from .config import ConfigError
from .db import events as db_events
from .scheduler import Worker

log = logging.getLogger(__name__)

KINDS = ("ntfy", "bark", "json")
SEVERITIES = ("info", "warning", "critical")
QUEUE_MAX = 1000
NTFY_PRIORITY = {"info": "3", "warning": "4", "critical": "5"}
NTFY_TAGS = {"info": "information_source", "warning": "warning", "critical": "rotating_light"}
BARK_LEVEL = {"info": "passive", "warning": "active", "critical": "timeSensitive"}


class WebhookConfigError(ConfigError):
    pass


def parse_webhooks(raw):
    """Check `[[webhooks]]`: each entry a table with url (http or https), kind (ntfy,
    bark, json; default json), min_severity (default warning), types (optional list),
    timeout_s, retries, headers. Raises WebhookConfigError naming the entry and key."""
    if raw in (None, {}):
        return []
    if not isinstance(raw, list):
        raise WebhookConfigError("webhooks in server.toml must be a list of tables: "
                                 "[[webhooks]] url = \"...\" kind = \"ntfy\"")
    out = []
    for i, w in enumerate(raw):
        where = f"webhooks[{i}] in server.toml"
        if not isinstance(w, dict):
            raise WebhookConfigError(f"{where} must be a table with a url")
        unknown = set(w) - {"url", "kind", "min_severity", "types", "timeout_s", "retries",
                            "headers", "name"}
        if unknown:
            raise WebhookConfigError(f"{where} has unknown keys {sorted(unknown)}; known: "
                                     "url, kind, min_severity, types, timeout_s, retries, "
                                     "headers, name")
        url = w.get("url")
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https") \
                or not urllib.parse.urlsplit(url).netloc:
            raise WebhookConfigError(f"{where}: url must be an http(s) URL, like "
                                     "\"https://ntfy.sh/my-topic\"")
        kind = w.get("kind", "json")
        if kind not in KINDS:
            raise WebhookConfigError(f"{where}: kind must be one of {', '.join(KINDS)}; "
                                     f"got {kind!r}")
        sev = w.get("min_severity", "warning")
        if sev not in SEVERITIES:
            raise WebhookConfigError(f"{where}: min_severity must be info, warning or "
                                     f"critical; got {sev!r}")
        types = w.get("types")
        if types is not None and (not isinstance(types, list)
                                  or not all(isinstance(t, str) for t in types)):
            raise WebhookConfigError(f"{where}: types must be a list of event types, like "
                                     "[\"OOM\", \"LOSS_NAN\"]")
        timeout = w.get("timeout_s", 5)
        retries = w.get("retries", 3)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout <= 120:
            raise WebhookConfigError(f"{where}: timeout_s must be a number of seconds, "
                                     "0 < timeout_s <= 120")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 20:
            raise WebhookConfigError(f"{where}: retries must be an integer from 0 to 20")
        headers = w.get("headers", {})
        if not isinstance(headers, dict) or not all(isinstance(v, str)
                                                    for v in headers.values()):
            raise WebhookConfigError(f"{where}: headers must be a table of strings")
        out.append({"url": url, "kind": kind, "min_severity": sev,
                    "types": set(types) if types else None, "timeout_s": float(timeout),
                    "retries": retries, "headers": headers,
                    "name": str(w.get("name") or urllib.parse.urlsplit(url).netloc)})
    return out


def matches(hook, event):
    rank = db_events.SEVERITY_RANK
    if rank.get(event.get("severity"), 0) < rank[hook["min_severity"]]:
        return False
    return hook["types"] is None or event.get("type") in hook["types"]


def _ascii(text, limit):
    # HTTP headers are latin-1 at best; ntfy reads a title header, so keep it plain
    return text.encode("ascii", "replace").decode()[:limit]


def title(event):
    where = (f"run {event['run_id']}" if event.get("run_id") else
             f"job {event['job_id']}" if event.get("job_id") else
             f"node {event['node']}" if event.get("node") else "GPUPlane")
    return f"{event['type']} ({event['severity']}) - {where}"


def build_request(hook, event):
    """(method, url, keyword arguments for requests) of one delivery."""
    t, msg = title(event), event.get("message") or event["type"]
    headers = dict(hook["headers"])
    if hook["kind"] == "ntfy":
        headers.update({"Title": _ascii(t, 250), "Priority": NTFY_PRIORITY[event["severity"]],
                        "Tags": f"{NTFY_TAGS[event['severity']]},{event['type'].lower()}"})
        return "POST", hook["url"], {"data": msg.encode(), "headers": headers}
    if hook["kind"] == "bark":
        # Bark: GET https://api.day.app/<device key>/<title>/<body>?group=&level=
        url = (hook["url"].rstrip("/") + "/" + urllib.parse.quote(t, safe="") + "/"
               + urllib.parse.quote(msg, safe=""))
        return "GET", url, {"params": {"group": "gpuplane", "level":
                                       BARK_LEVEL[event["severity"]]}, "headers": headers}
    return "POST", hook["url"], {"json": event, "headers": headers}


class Sender:
    """One webhook's queue and thread."""

    def __init__(self, hook, stop, session=None):
        self.hook = hook
        self.queue = deque()
        self.cond = threading.Condition()
        self.stop = stop
        self.session = session or requests.Session()
        self.sent = self.failed = self.dropped = 0
        self.thread = threading.Thread(target=self.run, daemon=True,
                                       name=f"gpuplane-webhook-{hook['name']}")

    def put(self, event):
        with self.cond:
            if len(self.queue) >= QUEUE_MAX:
                self.queue.popleft()
                self.dropped += 1
                log.warning("webhook %s: queue full (%d); dropped the oldest waiting event",
                            self.hook["name"], QUEUE_MAX)
            self.queue.append(event)
            self.cond.notify()

    def run(self):
        while not self.stop.is_set():
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.stop.is_set(), 1.0)
                if not self.queue:
                    continue
                event = self.queue.popleft()
            self.deliver(event)

    def deliver(self, event):
        method, url, kw = build_request(self.hook, event)
        delay = 1.0
        for attempt in range(self.hook["retries"] + 1):
            try:
                r = self.session.request(method, url, timeout=self.hook["timeout_s"], **kw)
                if r.status_code < 400:
                    self.sent += 1
                    return True
                why = f"answered {r.status_code}"
                if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    break            # our request is wrong: sending it again will not help
            except requests.RequestException as e:
                why = f"{type(e).__name__}: {str(e)[:200]}"
            if attempt < self.hook["retries"]:
                log.info("webhook %s: event %s %s; retrying in %.0f s", self.hook["name"],
                         event["id"], why, delay)
                if self.stop.wait(delay):
                    break
                delay = min(delay * 2, 60)
        self.failed += 1
        log.warning("webhook %s: gave up on event %s (%s): %s", self.hook["name"],
                    event["id"], event["type"], why)
        return False


class Webhooks(Worker):
    """Tails the events table and hands each new event to the matching webhooks."""
    name = "webhooks"
    interval = 1.0

    def __init__(self, db, cfg=None):
        super().__init__()
        self.db = db
        self.hooks = parse_webhooks((cfg or {}).get("webhooks"))
        self.senders = [Sender(h, self._stop) for h in self.hooks]
        self.cursor = None

    def notify(self, ids=None):
        if self.senders:            # with no webhook configured nothing is sent: no wake
            self._wake.set()

    def start(self):
        # only what happens from now on: a restart does not page anyone about old news
        self.cursor = db_events.last_id(self.db)
        for s in self.senders:
            s.thread.start()
        if self.hooks:
            log.info("webhooks: %s", ", ".join(f"{h['name']} ({h['kind']}, "
                                                 f"{h['min_severity']}+)" for h in self.hooks))
        super().start()

    def tick(self):
        if not self.senders:
            return
        while True:
            rows = db_events.query(self.db, after_id=self.cursor, limit=500)
            for ev in rows:
                for s in self.senders:
                    if matches(s.hook, ev):
                        s.put(ev)
                self.cursor = ev["id"]
            if len(rows) < 500:
                return

    def stop(self, timeout=5):
        super().stop(timeout)
        for s in self.senders:
            with s.cond:
                s.cond.notify_all()
            s.thread.join(timeout)
            if s.thread.is_alive():
                log.warning("thread %s did not stop within %s s", s.thread.name, timeout)
