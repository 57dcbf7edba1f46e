"""The event engine: a thread that runs the rules of gpuplane/rules.py on what arrives.

Ingest hands off cheaply (`offer_points`, `offer_log`, `offer_node_stats`: one append to a
bounded deque, no parsing, no SQL) and this thread does the work: splits points by key,
feeds the per-run windows, checks stalls, and stores findings debounced (one row per run
and type per `debounce_s`, with a count of repeats). Windows live in memory; after a
restart each is rebuilt from storage the first time its run is seen again, and findings
carry a fingerprint, so the same point seen twice never adds a second event.
SDK events (`run.log_event`) go through `record_user_event`, debounced the same way.
Everything about the rules and their settings: docs/events.md.
"""
import logging
import math
import threading
import time
from collections import deque
from itertools import compress

from . import rules, states, vocab
from .config import ConfigError
from .db import events as db_events, metric_defs, now_ms
from .hub import Hub
from .scheduler import Worker

log = logging.getLogger(__name__)

QUEUE_MAX = 10_000             # hand-offs waiting for the engine; beyond, the oldest go
STALL_CHECK_S = 5.0
HANDOFF_BATCH_S = 0.02   # a wake waits this long for more hand-offs: one wake per batch of
                         # them, not per job event or log record (each a thread switch)
USER_EVENTS_PER_MIN = 120      # distinct SDK events per run per minute; beyond, counted


_kinds: dict = {}


def _classify(key):
    """What the engine does with a key: (kind, base); kinds: sys (ignored), util, disk,
    lr, loss (a train loss), eval_loss, train, eval. Cached: keys repeat every batch."""
    hit = _kinds.get(key)
    if hit is None:
        role, base = rules.eval_pair(key)
        if vocab.is_system(key):
            kind = ("util" if key.endswith("/util") and key.startswith("sys/gpu")
                    else "disk" if key == "sys/disk_free_mb" else "sys")
        elif vocab.is_lr(key):
            kind = "lr"
        elif vocab.is_loss(key):
            kind = "eval_loss" if role == "eval" else "loss"
        else:
            kind = role
        hit = (kind, base)
        if len(_kinds) < 100_000:
            _kinds[key] = hit
    return hit


class SettingsError(ConfigError):
    pass


def settings(raw):
    """The `[events]` table of server.toml checked against rules.DEFAULTS: every key known,
    every value a number of the right sign. Raises SettingsError naming the key."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise SettingsError("[events] in server.toml must be a table of settings")
    out = dict(rules.DEFAULTS)
    out["enabled"] = True
    for k, v in raw.items():
        if k == "enabled":
            if not isinstance(v, bool):
                raise SettingsError("events.enabled in server.toml must be true or false")
            out[k] = v
            continue
        if k not in rules.DEFAULTS:
            raise SettingsError(f"events.{k} in server.toml is not a setting; known: "
                                + ", ".join(sorted(rules.DEFAULTS)))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise SettingsError(f"events.{k} in server.toml must be a number >= 0 "
                                f"(default {rules.DEFAULTS[k]}); got {v!r}")
        out[k] = v
    return out


class RunWindows:
    """Everything the engine remembers of one run."""

    def __init__(self, ctx):
        self.ctx = ctx                  # run_id, job_id, attempt, node, state, source
        self.spikes = {}                # key -> rules.Spike
        self.lr = None                  # rules.LrTrack: the run's learning rate (made with cfg)
        self.diverge = {}               # key -> rules.Diverge
        self.overfit = {}               # eval key -> rules.Overfit
        self.train_keys = {}            # base -> train key
        self.idle = {}                  # key -> rules.GpuIdle
        self.activity = None            # rules.Activity, job runs only
        self.rebuilt = set()            # keys whose window was loaded from storage
        self.checked_state = time.monotonic()


class Engine(Worker):
    name = "events"
    interval = 0.5

    def __init__(self, db, cfg=None, hub=None):
        super().__init__()
        self.db = db
        self.cfg = settings((cfg or {}).get("events"))
        self.enabled = self.cfg["enabled"]
        self.window_ms = int(self.cfg["debounce_s"] * 1000)
        self.hub = hub or Hub()         # wakes GET /events/stream followers
        self.listeners = []             # called with the list of new event ids
        self._queue = deque()
        self._dropped = 0
        self._runs = {}
        self._recent = {}               # debounce key -> (event id, until monotonic, pending)
        self._fingerprints = set()      # findings stored or counted (the DB has the rest)
        self._next_stall = 0.0
        self._user = {}                 # run -> [window start (monotonic), distinct names]
        self._user_lock = threading.Lock()
        self._user_recent = {}          # (run, name) -> [event id, until, pending count]
        self.stats = {"handoffs": 0, "dropped": 0, "findings": 0, "stored": 0}
        self.started_ms = now_ms()

    # -- hand-off from ingest (request and gateway threads): O(1), never blocks ----------

    def _offer(self, item):
        if not self.enabled:
            return
        if len(self._queue) >= QUEUE_MAX:
            self._queue.popleft()
            self._dropped += 1
        self._queue.append(item)
        self._wake.set()

    def offer_points(self, run_id, keys, cols):
        """Points just committed for a run: keys and the (kidx, steps, values, ts) columns."""
        self._offer(("points", run_id, keys, cols, now_ms()))

    def offer_log(self, job_id, attempt, lines):
        self._offer(("log", job_id, attempt, lines, now_ms()))

    def offer_lifecycle(self, event):
        """A lifecycle event was committed (gpuplane/lifecycle.py listener)."""
        self._offer(("life", event, None, None, now_ms()))
        if not self.enabled:
            self.notify([event.get("id")])

    def offer_node_stats(self, node, host):
        self._offer(("node", node, host, None, now_ms()))

    # -- the thread --------------------------------------------------------------------

    def settle_s(self):
        # a wake takes the hand-offs of the next HANDOFF_BATCH_S with it, unless the
        # queue is filling up
        return HANDOFF_BATCH_S if len(self._queue) < QUEUE_MAX // 2 else 0.0

    def tick(self):
        if self._dropped:
            n, self._dropped = self._dropped, 0
            self.stats["dropped"] += n
            log.warning("event engine: %d hand-offs dropped (queue full at %d); their "
                        "points are stored, only not checked", n, QUEUE_MAX)
        new = []
        while self._queue and not self._stop.is_set():
            item = self._queue.popleft()
            self.stats["handoffs"] += 1
            try:
                new += self._handle(item)
            except Exception:
                log.exception("event engine: a %s hand-off failed; skipped", item[0])
        if time.monotonic() >= self._next_stall:
            self._next_stall = time.monotonic() + STALL_CHECK_S
            new += self._check_stalls()
        new += self._flush_counts()
        if new:
            self.notify(new)

    def notify(self, ids):
        self.hub.publish()
        for fn in self.listeners:
            try:
                fn(ids)
            except Exception:
                log.exception("event listener %r failed", fn)

    # -- findings -> rows ----------------------------------------------------------------

    def _store(self, f, run=None, node=None, fingerprint=None, ts=None, ctx=None):
        """Store one finding, debounced in memory first (a burst of the same finding costs
        no SQL), in the database otherwise. Returns [id] when a row was added."""
        self.stats["findings"] += 1
        ctx = run.ctx if run else (ctx or {})
        subject = ctx.get("id") or ctx.get("job_id") or node
        dkey = (f["type"], subject)
        if fingerprint is not None:
            if fingerprint in self._fingerprints:     # the very same finding again
                return []
            if len(self._fingerprints) > 100_000:
                self._fingerprints.clear()
            self._fingerprints.add(fingerprint)
        now = time.monotonic()
        hit = self._recent.get(dkey)
        if hit and hit[1] > now:
            hit[2] += 1
            return []
        ev = {"type": f["type"], "severity": f["severity"], "message": f["message"],
              "step": f["step"], "data": f["evidence"], "run_id": ctx.get("id"),
              "job_id": ctx.get("job_id"), "node": node or ctx.get("node"),
              "fingerprint": fingerprint, "ts": ts}
        with self.db.tx() as c:
            event_id, added = db_events.record(c, ev, self.window_ms)
        if event_id is not None:
            self._recent[dkey] = [event_id, now + self.window_ms / 1000, 0]
        if added:
            self.stats["stored"] += 1
            log.info("event %s: %s", f["type"], f["message"])
            return [event_id]
        return []

    def _flush_user_locked(self):
        pending = [v for v in self._user_recent.values() if v[2]]
        if pending:
            with self.db.tx() as c:
                for v in pending:
                    db_events.add_count(c, v[0], v[2])
                    v[2] = 0
        now = time.monotonic()
        self._user_recent = {k: v for k, v in self._user_recent.items() if v[1] > now}

    def _flush_counts(self):
        with self._user_lock:
            self._flush_user_locked()
        now = time.monotonic()
        pending = [(k, v) for k, v in self._recent.items() if v[2]]
        if pending:
            with self.db.tx() as c:
                for _, v in pending:
                    db_events.add_count(c, v[0], v[2])
                    v[2] = 0
        for k in [k for k, v in self._recent.items() if v[1] <= now]:
            del self._recent[k]
        return []

    # -- hand-offs ---------------------------------------------------------------------

    def _run(self, run_id):
        run = self._runs.get(run_id)
        if run is None:
            ctx = db_events.run_context(self.db, run_id)
            if ctx is None:
                return None
            run = self._runs[run_id] = RunWindows(ctx)
            if len(self._runs) > 5000:        # forget the least recently added
                self._runs.pop(next(iter(self._runs)))
        elif time.monotonic() - run.checked_state > STALL_CHECK_S:
            run.ctx = db_events.run_context(self.db, run_id) or run.ctx
            run.checked_state = time.monotonic()
        return run

    def _handle(self, item):
        kind = item[0]
        if kind == "points":
            return self._points(*item[1:])
        if kind == "log":
            return self._log(*item[1:])
        if kind == "life":
            return self._lifecycle(item[1])
        if kind == "node":
            _, node, host, _, _ = item
            f = rules.disk_low((host or {}).get("disk_free_mb"), f"node {node}'s GPUPlane home",
                               self.cfg)
            return self._store(f, node=node) if f else []
        return []

    def _points(self, run_id, keys, cols, arrived):
        run = self._run(run_id)
        if run is None:
            return []
        kidx, steps, values, ts = cols
        if not steps:
            return []
        new = []
        progress = False
        n = len(keys)
        # The usual layout: every key at every step, in key order (0, 1, .., n-1, 0, 1, ..).
        # Checked at every position: a batch where some keys come at some steps only (a
        # train loss every step, an eval loss once an epoch) can match it at one key's
        # positions by chance, and slicing it would hand that key every other point.
        regular = n > 1 and len(kidx) % n == 0 and \
            all(kidx[j::n].count(j) == len(kidx) // n for j in range(n))
        # the learning rate first: the spike rule's restart grace then knows the rate at
        # every step of the batch, as rules.spikes() (diagnose_run) does
        order = sorted(range(n), key=lambda j: _classify(keys[j])[0] != "lr")
        for i in order:
            key = keys[i]
            kind, base = _classify(key)
            progress = progress or not vocab.is_system(key)   # sys/* comes while hung too
            if kind == "sys":
                continue
            if kind == "train":
                run.train_keys.setdefault(base, key)
                if not any(o.train_key == key for o in run.overfit.values()):
                    continue
            if n == 1:
                ks, kv, kt = steps, values, ts
            elif regular:
                ks, kv, kt = steps[i::n], values[i::n], ts[i::n]
            else:
                sel = list(map(i.__eq__, kidx))
                ks = list(compress(steps, sel))
                if not ks:
                    continue
                kv, kt = list(compress(values, sel)), list(compress(ts, sel))
            new += self._key_points(run, key, kind, base, ks, kv, kt)
        if progress and run.ctx.get("job_id") is not None:
            if run.activity is None:
                run.activity = self._rebuild_activity(run)
            run.activity.seen(arrived, max(steps))
        return new

    def _key_points(self, run, key, kind, base, steps, values, ts):
        new = []
        rid = run.ctx["id"]
        if kind == "disk":
            f = rules.disk_low(values[-1], f"job {run.ctx.get('job_id')}'s working directory",
                               self.cfg, step=steps[-1])
            return self._store(f, run) if f else []
        if kind == "util":
            if run.ctx.get("job_id") is None:
                return []
            idle = run.idle.get(key)
            if idle is None:
                idle = run.idle[key] = rules.GpuIdle(key, self.cfg)
            for s, v, t in zip(steps, values, ts):
                f = idle.push(s, v, t)
                if f:
                    new += self._store(f, run)
            return new
        if kind == "lr":
            if run.lr is None:
                run.lr = rules.LrTrack(self.cfg)
            run.lr.points(steps, values)
            return new
        if kind in ("loss", "eval_loss"):
            f = rules.nonfinite(key, steps, values)
            if f:
                new += self._store(f, run, fingerprint=f"LOSS_NAN:{rid}:{key}:{f['step']}")
        if kind == "loss":
            sp = run.spikes.get(key)
            if sp is None:
                if run.lr is None:
                    run.lr = rules.LrTrack(self.cfg)
                sp = run.spikes[key] = rules.Spike(key, self.cfg, lr=run.lr)
                self._rebuild(run, key, steps[0], sp.extend, int(self.cfg["spike_window"]))
            for f in sp.extend(steps, values):
                new += self._store(f, run, fingerprint=f"LOSS_SPIKE:{rid}:{key}:{f['step']}")
            dv = run.diverge.get(key)
            if dv is None:
                dv = run.diverge[key] = rules.Diverge(key, self.cfg)
                self._rebuild(run, key, steps[0], dv.extend, int(self.cfg["diverge_window"]))
            for f in dv.extend(steps, values):
                new += self._store(f, run, fingerprint=f"LOSS_DIVERGED:{rid}:{key}")
        if kind in ("loss", "train"):
            run.train_keys.setdefault(base, key)
            for o in run.overfit.values():
                if o.train_key == key:
                    o.train_points(steps, values)
            return new
        # an eval key (eval_loss too)
        o = run.overfit.get(key)
        train_key = run.train_keys.get(base)
        if o is None and train_key is not None:
            # the direction a metric definition gives the key wins over its name's
            # (gpuplane/vocab.py); unknown, the rule keeps quiet on it
            defined = metric_defs.defined_direction(self.db, key, run.ctx.get("project") or "",
                                                    run.ctx.get("experiment") or "")[0]
            o = run.overfit[key] = rules.Overfit(key, train_key, self.cfg, direction=defined)
            self._rebuild(run, train_key, steps[0] + 1, o.train_points, 1024)
            self._rebuild(run, key, steps[0], o.eval_points, 64)
        if o is not None:
            for f in o.eval_points(steps, values):
                if not o.fired:
                    o.fired = True
                    new += self._store(f, run, fingerprint=f"OVERFITTING_SUSPECTED:{rid}:{key}")
        return new

    def _rebuild(self, run, key, before_step, feed, limit):
        """Fill a fresh window from storage (after a restart, or a key first seen in a
        batch that is not its first): what was already judged is learnt from, not judged."""
        pts = db_events.recent_points(self.db, run.ctx["id"], key, before_step, limit)
        if pts:
            feed([p[0] for p in pts], [p[1] for p in pts])
            run.rebuilt.add(key)

    def _rebuild_activity(self, run):
        act = rules.Activity(self.cfg)
        for t in db_events.last_activity(self.db, run.ctx["id"], run.ctx.get("job_id"),
                                         run.ctx.get("attempt")):
            act.seen(t)
        # the server was down or just started: nothing could arrive, so that is no silence
        act.last = max(act.last or 0, self.started_ms)
        return act

    def _log(self, job_id, attempt, lines, arrived):
        run_id = db_events.run_of_attempt(self.db, job_id, attempt)
        run = self._run(run_id) if run_id is not None else None
        if run is None:
            return []
        if run.activity is None:
            run.activity = self._rebuild_activity(run)
        run.activity.seen(arrived)
        texts = [str(ln[2]) if isinstance(ln, (list, tuple)) and len(ln) == 3 else str(ln)
                 for ln in lines]
        f = rules.oom_line(texts)
        if f:
            return self._store(f, run)
        return []

    def _lifecycle(self, ev):
        """Fan the lifecycle event out (it is stored already); a job that failed with the
        OOM kind also gets an OOM event, the one a webhook for OOM waits for."""
        out = [ev.get("id")]
        data = ev.get("data") or {}
        if ev.get("type") == "FAILED" and data.get("failure_kind") == "OOM":
            ctx = {"id": ev.get("run_id"), "job_id": ev.get("job_id"), "node": ev.get("node")}
            f = rules.finding("OOM", rules.CRITICAL, None,
                              f"job {ev.get('job_id')} ran out of memory and failed (it is not "
                              f"retried automatically): lower the batch size, use gradient "
                              f"accumulation or checkpointing, or ask for a bigger GPU",
                              failure_kind="OOM", exit_code=data.get("exit_code"),
                              attempt=data.get("attempt"))
            out += self._store(f, ctx=ctx, fingerprint=f"OOM:{ev.get('job_id')}:"
                               f"{data.get('attempt')}")
        if ev.get("type") in ("SUCCEEDED", "FAILED", "CANCELLED", "RETRIED") and ev.get("run_id"):
            self._runs.pop(ev["run_id"], None)
        return out

    def _check_stalls(self):
        new = []
        now = now_ms()
        running = {r[0] for r in db_events.running_job_runs(self.db)}
        for run_id in running:
            run = self._run(run_id)
            if run is None:
                continue
            if run.activity is None:
                run.activity = self._rebuild_activity(run)
            f = run.activity.check(now)
            if f:
                # one per silence: the fingerprint names the moment of the last activity
                new += self._store(f, run, fingerprint=f"STALLED:{run_id}:{run.activity.last}")
        for run_id in [r for r, w in self._runs.items()
                       if w.ctx.get("state") not in states.RUN_ACTIVE
                       and r not in running and w.ctx.get("source") == "job"]:
            self._runs.pop(run_id, None)
        return new

    # -- SDK events (POST /runs/<id>/events), on the request thread --------------------

    def record_user_event(self, run, name, data, step, ts):
        """Store an SDK event, debounced per run and name; past USER_EVENTS_PER_MIN
        distinct names in a minute (from the first event of the run's current window, not
        a calendar minute: a burst across a minute's turn gets no second allowance),
        further ones are counted on one USER_FLOOD event. Returns (event id, added)."""
        now = time.monotonic()
        with self._user_lock:
            window = self._user.get(run["id"])
            if window is None or now - window[0] >= 60:
                if len(self._user) > 10_000:
                    self._user = {k: w for k, w in self._user.items() if now - w[0] < 60}
                window = self._user[run["id"]] = [now, set()]
            names = window[1]
            flood = name not in names and len(names) >= USER_EVENTS_PER_MIN
            if not flood:
                names.add(name)
            # a repeat inside the window is only counted here; the engine thread adds the
            # counts to the row each tick, so a flood costs no SQL per call
            dkey = (run["id"], None if flood else name)
            hit = self._user_recent.get(dkey)
            if hit and hit[1] > time.monotonic():
                hit[2] += 1
                self._wake.set()
                return hit[0], False
        if flood:
            ev = {"type": "USER_FLOOD", "severity": "warning", "run_id": run["id"],
                  "job_id": run.get("job_id"), "node": run.get("node"),
                  "message": f"run {run['id']} logs more than {USER_EVENTS_PER_MIN} "
                             f"different events a minute; the rest are only counted here",
                  "data": {"example": name}}
        else:
            ev = {"type": "USER", "severity": "info", "run_id": run["id"],
                  "job_id": run.get("job_id"), "node": run.get("node"), "message": name,
                  "data": {"name": name, **(data or {})}, "step": step, "ts": ts}
        with self.db.tx() as c:
            event_id, added = db_events.record(c, ev, self.window_ms)
        if event_id is not None:
            with self._user_lock:
                if len(self._user_recent) > 100_000:
                    self._flush_user_locked()
                self._user_recent.setdefault(
                    dkey, [event_id, time.monotonic() + self.window_ms / 1000, 0])
        if added:
            if flood:
                log.warning("run %s: SDK event flood; counting further events on event %s",
                            run["id"], event_id)
            self.notify([event_id])
        return event_id, added
