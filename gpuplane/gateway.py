"""The agent WebSocket endpoint and the command channel to agents.

The wire is written down in docs/protocol.md; this module is the server's one place
that speaks it: every message to an agent is built here. Each connected agent holds one
gunicorn thread (this handler) for as long as it is connected. State changes an agent
reports go through gpuplane/lifecycle.py, which hands agent commands back here
(`start`, `cancel`). The gateway does not know the scheduler.
"""
import json
import logging
import math
import sqlite3
import threading
import time

from flask import g, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from .auth import requires
from .streams import clear_timeout
from .errors import ApiError
from . import metricwire, placeholders, retention, states, timelimit
from .db import checkpoints, events, jobs, logs, metrics, nodes, now_ms, runs, tokens

log = logging.getLogger(__name__)

WS_PATH = "/api/v1/agent/ws"
MAX_FRAME = 8 * 1024 * 1024
CLOSE_UNSUPPORTED, CLOSE_TOO_BIG, CLOSE_PROTOCOL, CLOSE_UNAUTHORIZED = 1003, 1009, 4400, 4401
CLOSE_WRONG_NODE, CLOSE_NODE_CONNECTED = 4403, 4409
RECORD_KINDS = ("job", "log", "metrics", "node_stats", "checkpoint", "event")


# What a record with missing, mistyped or out-of-range fields raises while it is applied
# (OverflowError: an int SQLite cannot hold; IntegrityError: a NULL where one is not
# allowed; ProgrammingError: a list or dict bound as a value). OperationalError (disk
# full, I/O) is not here: that is the server's trouble, and the agent resends later.
MALFORMED = (KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError,
             sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)


class ProtocolError(Exception):
    pass


class AgentConnection:
    def __init__(self, ws, node):
        self.ws = ws
        self.node = node
        self.lock = threading.Lock()     # simple_websocket's send is not thread-safe
        self.last_message = time.monotonic()
        self.synced = False

    def send(self, msg):
        with self.lock:
            self.ws.send(json.dumps(msg))

    def close(self, code=1000, reason=""):
        with self.lock:
            try:
                self.ws.close(code, reason[:120])
            except Exception:   # already closed
                pass


class Gateway:
    def __init__(self, db, hub, cfg, lifecycle):
        self.db = db
        self.hub = hub
        self.cfg = cfg
        self.lifecycle = lifecycle
        self.events = None          # the event engine (gpuplane/events.py): hand-offs
        self._conns = {}
        self._lock = threading.Lock()

    # -- commands to agents -------------------------------------------------------------

    def connected(self, node):
        with self._lock:
            return node in self._conns

    def send(self, node, msg):
        """Send a command; False when the node is not connected (it is re-sent on sync)."""
        with self._lock:
            conn = self._conns.get(node)
        if conn is None:
            return False
        try:
            conn.send(msg)
            return True
        except Exception as e:
            log.info("send to %s failed (%s); it will be reconciled on reconnect", node, e)
            return False

    def start(self, job, ingest_token):
        """Send the start command of a job's current attempt (lifecycle.assign)."""
        return self.send(job["node"], self.start_message(job, ingest_token))

    def cancel(self, node, job_id, attempt, warn=None):
        """Stop an attempt; `warn`: the job (a preemption), whose warning signal goes
        first and the stop its lead later (docs/scheduling.md)."""
        return self.send(node, cancel_message(
            job_id, attempt, self.time_signal(warn) if warn is not None else None))

    def delete_checkpoints(self, node, job_id, working_dir, files):
        """Checkpoint retention (gpuplane/retention.py): the owning agent deletes these
        registered files of the job, inside its working dir, and reports each."""
        return self.send(node, {"type": "delete_checkpoints", "job_id": job_id,
                                "working_dir": working_dir, "files": files})

    def start_message(self, job, ingest_token):
        # {job}, {attempt} and {run} in the command and folders (gpuplane/placeholders.py)
        names = {"job": job["id"], "attempt": job["attempt"], "run": job["run_id"]}
        return {"type": "start", "job_id": job["id"], "attempt": job["attempt"],
                "run_id": job["run_id"], "command": placeholders.fill(job["command"], names),
                "working_dir": job["working_dir"], "env": job["env"],
                "gpus": job["gpu_indices"] or [], "cpu_only": job["cpu_only"],
                "tb_dir": placeholders.fill(job["tb_dir"], names),
                "watch_dir": placeholders.fill(job["watch_dir"], names),
                "image": job.get("image"),
                # what a Slurm agent asks sbatch for (docs/slurm.md); a local one runs
                # on the cards in `gpus`
                "gpu_count": 0 if job["cpu_only"] else job["gpus"],
                "cpus": job.get("cpus"), "mem_mb": job.get("mem_mb"),
                "time_limit_min": timelimit.minutes(job.get("time_limit_s")),
                # the limit, and the warning before it (docs/scheduling.md)
                "time_limit_s": job.get("time_limit_s"),
                "time_signal": self.time_signal(job),
                # the job asked for it (--signal): sent even to a program that does not
                # handle it (the server's default goes only to one that does)
                "time_signal_asked": bool(job.get("time_signal")),
                "server_url": self.server_url(), "ingest_token": ingest_token,
                # an evaluation needs its checkpoint: gone, the attempt is DISPATCH_FAILED
                "require_paths": [job["env"]["GPUCTL_CHECKPOINT_PATH"]]
                if job["kind"] == "EVALUATE" and job["env"].get("GPUCTL_CHECKPOINT_PATH")
                else [],
                # an attempt after a lost or failed one: the checkpoints it may resume from
                "resume": self._resume(job) if job.get("resume") else []}

    def time_signal(self, job):
        """[name, lead seconds] of the warning before the job's limit: its own --signal,
        else the server's time_signal (whose lead, for a limit shorter than twice it, is
        half the limit)."""
        return timelimit.warning_signal(job, self.cfg.get("time_signal"))

    def _resume(self, job):
        with self.db.read() as conn:
            return checkpoints.resume_candidates(conn, job["id"], job["attempt"])

    def close_all(self):
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.close(1001, "server shutting down")

    def server_url(self):
        from .config import server_url
        return server_url(self.cfg)

    # -- the endpoint -------------------------------------------------------------------

    def register(self, app):
        sock = Sock(app)

        @app.before_request
        def _agent_auth():
            if request.path == WS_PATH:
                try:
                    requires("agent")(lambda: None)()
                except ApiError as e:
                    if request.headers.get("Upgrade", "").lower() != "websocket":
                        raise
                    # docs/protocol.md: a refused token is a close with 4401 and a
                    # reason, which the agent can tell from a network failure
                    g.agent_auth_error = e
                    return
                # 503 + Retry-After beyond the thread budget (gpuplane/streams.py)
                app.config["STREAMS"].acquire("agent")
                g.agent_slot = True
                clear_timeout(request.environ)    # this connection stays open on purpose

        @app.teardown_request
        def _agent_slot(_exc):
            if g.pop("agent_slot", False):
                app.config["STREAMS"].release("agent")

        @sock.route(WS_PATH)
        def agent_ws(ws):
            err = g.pop("agent_auth_error", None)
            if err is not None:
                log.warning("agent connection refused: %s", err.message)
                _close(ws, CLOSE_UNAUTHORIZED, err.message)
                return
            tok = g.get("token") or {}
            # An agent token speaks for its one node; an admin token for any.
            self.handle(ws, bound_node=tok.get("node") if tok.get("scope") == "agent" else None)
        app.view_functions["agent_ws"].required_scope = "agent"

    def handle(self, ws, bound_node=None):
        conn = None
        try:
            hello = self._receive(ws, timeout=15)
            if hello is None or hello.get("type") != "hello":
                raise ProtocolError("the first message must be hello")
            conn = self._on_hello(ws, hello, bound_node)
            hb = self.cfg.heartbeat_s
            while True:
                msg = self._receive(ws, timeout=1.0)
                if msg is None:
                    if not ws.connected:
                        break
                    if time.monotonic() - conn.last_message > 3 * hb:
                        log.warning("node %s: no heartbeat for %.0f s; closing", conn.node, 3 * hb)
                        conn.close(1001, "heartbeat timeout")
                        break
                    continue
                conn.last_message = time.monotonic()
                self._dispatch(conn, msg)
        except ProtocolError as e:
            log.warning("agent protocol error from %s: %s", conn.node if conn else "?", e)
            _close(ws, getattr(e, "code", CLOSE_PROTOCOL), str(e))
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("agent connection failed")
            _close(ws, 1011, "server error")
        finally:
            if conn is not None:
                self._on_disconnect(conn)

    def _receive(self, ws, timeout):
        data = ws.receive(timeout=timeout)
        if data is None:
            return None
        if isinstance(data, bytes):
            raise _protocol("binary frames are not part of the protocol", CLOSE_UNSUPPORTED)
        if len(data) > MAX_FRAME:
            raise _protocol("frame larger than 8 MiB", CLOSE_TOO_BIG)
        try:
            msg = json.loads(data)
        except (ValueError, RecursionError):
            raise _protocol("a frame that is not JSON") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise _protocol("a message must be a JSON object with a 'type'")
        return msg

    def _on_hello(self, ws, msg, bound_node=None):
        node, epoch = msg.get("node"), msg.get("epoch")
        if not isinstance(node, str) or not node or len(node) > 200:
            raise _protocol("hello needs a 'node' name")
        if bound_node is not None and node != bound_node:
            raise _protocol(f"this agent token is bound to node {bound_node!r}, not {node[:60]!r}; "
                            f"start the agent with --name {bound_node}, or give it a token "
                            "made for this node (`gpuplane token create --agent NODE`)",
                            CLOSE_WRONG_NODE)
        if not isinstance(epoch, str) or not epoch or len(epoch) > 200:
            raise _protocol("hello needs an 'epoch'")
        gpus = msg.get("gpus") or []
        why = gpu_list_problem(gpus)
        if why:
            raise _protocol(f"hello: {why}")
        slots = msg.get("cpu_slots")
        if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool)
                                  or not 0 <= slots <= 4096):
            raise _protocol("'cpu_slots' must be an integer from 0 to 4096")
        if msg.get("runner") not in (None, "process", "slurm"):
            raise _protocol("'runner' must be \"process\" or \"slurm\"")
        if msg.get("slurm") is not None and (not isinstance(msg["slurm"], dict)
                                             or len(json.dumps(msg["slurm"])) > 64 * 1024):
            raise _protocol("'slurm' must be an object (what the partition offers) of at "
                            "most 64 KiB")
        for name in ("hostname", "version"):
            if msg.get(name) is not None and (not isinstance(msg[name], str)
                                              or len(msg[name]) > 1000):
                raise _protocol(f"'{name}' must be a string of at most 1000 characters")
        conn = AgentConnection(ws, node)
        limit = 3 * self.cfg.heartbeat_s

        def alive(c):
            return (c is not None and getattr(c.ws, "connected", True)
                    and time.monotonic() - c.last_message < limit)
        with self._lock:
            old = self._conns.get(node)
        # An agent that closed its old connection and reconnects at once: the old one's
        # close may still be on its way. Give it a moment before calling it alive.
        deadline = time.monotonic() + 1.0
        while alive(old) and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            old = self._conns.get(node)
            if alive(old):
                # A live connection is not pushed off by a newcomer with the same name
                # (which would be handed its running jobs); a silent one is.
                raise _protocol(f"node {node[:60]} is already connected and heard from in the "
                                f"last {limit:.0f} s; stop the other agent of that name",
                                CLOSE_NODE_CONNECTED)
            self._conns[node] = conn
        if old is not None:
            old.close(CLOSE_NODE_CONNECTED, "replaced by a newer connection of the same node "
                      "(this one was silent)")
        try:
            cursor = self.lifecycle.node_up(msg)
        except BaseException:
            with self._lock:
                if self._conns.get(node) is conn:
                    del self._conns[node]
            raise
        conn.send({"type": "welcome", "node": node, "epoch": epoch, "cursor": cursor,
                   "heartbeat_s": self.cfg.heartbeat_s})
        log.info("node %s connected (epoch %s, cursor %d, %d GPUs)", node, epoch[:8], cursor,
                 len(gpus))
        return conn

    def _on_disconnect(self, conn):
        with self._lock:
            if self._conns.get(conn.node) is conn:
                del self._conns[conn.node]
                still_ours = True
            else:
                still_ours = False
        if still_ours:
            self.lifecycle.node_down(conn.node)
            log.info("node %s disconnected", conn.node)
        else:
            self.lifecycle.wake_scheduler()

    def _dispatch(self, conn, msg):
        kind = msg["type"]
        if kind == "heartbeat":
            nodes.seen(self.db, conn.node, synced=conn.synced)
            # answered, so an agent behind a silent network black hole notices too
            conn.send({"type": "heartbeat", "ts": now_ms()})
        elif kind == "batch":
            reply = self.apply_batch(conn.node, msg)
            conn.send(reply)
        elif kind == "sync":
            for cmd in self.reconcile(conn.node, msg):
                conn.send(cmd)
            conn.synced = True
        else:
            raise _protocol(f"unknown message type {kind[:40]!r}")

    # -- applying the outbox ------------------------------------------------------------

    def apply_batch(self, node, msg):
        records = msg.get("records")
        if not isinstance(records, list) or not all(
                isinstance(r, dict) and isinstance(r.get("seq"), int) for r in records):
            raise _protocol("a batch needs 'records': objects each with an integer 'seq'")
        published = False
        # durable: once acked the agent forgets these records, so the ack must not be
        # lost to a power cut (synchronous=FULL for this commit)
        with self.lifecycle.transaction(durable=True) as t:
            c = t.conn
            epoch, cursor = nodes.cursor(c, node)
            if msg.get("epoch") != epoch:
                raise _protocol("batch for another epoch; send hello again")
            new = sorted((r for r in records if r["seq"] > cursor), key=lambda r: r["seq"])
            if new and new[0]["seq"] != cursor + 1:
                return {"type": "resend", "from": cursor + 1}
            last = cursor
            for rec in new:
                if rec["seq"] != last + 1:
                    break           # a gap inside the batch: apply the prefix only
                refused = self._not_this_nodes(c, node, rec)
                if refused:
                    log.warning("node %s: refused %s record seq %d: %s", node,
                                rec.get("kind"), rec["seq"], refused)
                    last = rec["seq"]
                    continue
                try:
                    with t.savepoint("rec"):
                        published = self._apply_record(t, node, rec) or published
                except MALFORMED as e:
                    # A malformed record must not wedge the node's outbox forever.
                    log.warning("node %s: skipped malformed %s record seq %d (%s)", node,
                                rec.get("kind"), rec["seq"], e)
                last = rec["seq"]
            nodes.set_cursor(c, node, last)
        if published:
            self.hub.publish()     # log lines; state changes publish through lifecycle
        return {"type": "ack", "seq": last}

    @staticmethod
    def _not_this_nodes(c, node, rec):
        """Authorisation of one record: a node reports only about the attempts assigned to
        it and the runs of those attempts. Returns why not, or None."""
        kind = rec.get("kind")
        try:
            if kind in ("job", "log"):
                job_id, attempt = int(rec["job_id"]), int(rec["attempt"])
                if runs.node_of_attempt(c, job_id, attempt) != node:
                    return f"job {job_id} attempt {attempt} is not assigned to this node"
                return None
            if kind in ("metrics", "checkpoint", "event", "checkpoint_deleted") \
                    and rec.get("run_id") is not None:
                run_id = int(rec["run_id"])
                if runs.node_of(c, run_id) != node:
                    return f"run {run_id} is not a run of this node's attempts"
            if kind == "event" and rec.get("job_id") is not None:
                job_id = int(rec["job_id"])
                if not runs.job_on_node(c, job_id, node):
                    return f"job {job_id} never ran on this node"
        except (KeyError, TypeError, ValueError, OverflowError):
            return None             # malformed: the apply step skips it as such
        return None

    def _apply_record(self, t, node, rec):
        """Apply one outbox record inside the batch transaction `t`. Returns whether log
        followers should hear of it."""
        c = t.conn
        kind = rec.get("kind")
        ts = int(rec.get("ts") or now_ms())
        if kind == "job":
            job_id, attempt = int(rec["job_id"]), int(rec["attempt"])
            if rec["state"] == states.RUNNING:
                resumed = rec.get("resumed_from")
                self.lifecycle.started(job_id, attempt, ts, t=t,
                                       slurm_job_id=_slurm_id(rec.get("slurm_job_id")),
                                       resumed_from=int(resumed)
                                       if isinstance(resumed, int) else None)
                return False
            if rec["state"] == states.PENDING:      # queued in Slurm (docs/slurm.md)
                reason = rec.get("message")
                self.lifecycle.waiting_in_slurm(
                    job_id, attempt, _slurm_id(rec.get("slurm_job_id")),
                    str(reason)[:500] if reason else None, t=t)
                return False
            if rec["state"] == states.EXITED:
                code = rec.get("exit_code")
                self.lifecycle.finished(job_id, attempt,
                                        exit_code=int(code) if code is not None else None,
                                        failure_kind=rec.get("failure_kind"),
                                        message=rec.get("message"), ts=ts, t=t)
                return False
            raise ValueError(f"unknown job state {rec['state']!r}")
        if kind == "log":
            added = logs.append(c, int(rec["job_id"]), int(rec["attempt"]), rec["lines"],
                                keep=self.cfg.log_keep_lines)
            if added and self.events:
                self.events.offer_log(int(rec["job_id"]), int(rec["attempt"]), rec["lines"])
            return bool(added)
        if kind == "metrics":
            run_id = int(rec["run_id"])
            if runs.exists(c, run_id):
                acc = metrics.limit_keys(c, run_id,
                                         metricwire.accept_batch(*_agent_points(rec["points"])))
                if acc.refused.total:
                    # the good points of the record are kept; the bad ones counted
                    log.warning("node %s: run %d: %s", node, run_id, acc.refused.sentence())
                    events.points_refused(c, run_id, acc.refused, node=node)
                if acc.cols[1]:
                    ids, _ = metrics.resolve_keys(c, run_id, acc.keys)
                    metrics.insert_points(c, ids, acc.cols)
                    if self.events:     # checked by the event engine on its own thread
                        self.events.offer_points(run_id, acc.keys, acc.cols)
            return False
        if kind == "node_stats":
            why = gpu_list_problem(rec.get("gpus") or []) or _flat_problem(
                rec.get("host") or {}, "'host'", MAX_STAT_FIELDS)
            if why:
                raise ValueError(f"node_stats: {why}")      # skipped as malformed
            nodes.set_stats(c, node, {"gpus": rec.get("gpus") or [],
                                      "host": rec.get("host") or {}, "ts": ts})
            if self.events and isinstance(rec.get("host"), dict):
                self.events.offer_node_stats(node, rec["host"])
            return False
        if kind == "checkpoint":
            run_id = int(rec["run_id"])
            if runs.exists(c, run_id):
                step = rec.get("step")
                checkpoints.register(
                    c, run_id, str(rec["path"]),
                    step=int(step) if step is not None else None, step_source="name",
                    epoch=float(rec["epoch"]) if rec.get("epoch") is not None else None,
                    size_bytes=rec.get("size_bytes"), fingerprint=rec.get("fingerprint"),
                    fmt=rec.get("format"), source="watcher", ts=ts,
                    mtime_ns=_int_or_none(rec.get("mtime_ns")),
                    content=str(rec["content"])[:128] if rec.get("content") else None)
            return False
        if kind == "checkpoint_deleted":      # retention (gpuplane/retention.py)
            ckpt_id, run_id = int(rec["checkpoint_id"]), int(rec["run_id"])
            if rec.get("deleted"):
                freed = rec.get("bytes_freed")
                checkpoints.mark_deleted(c, ckpt_id, run_id,
                                         int(freed) if isinstance(freed, int) else None, ts)
            else:
                why = str(rec.get("reason") or "the agent kept it")[:500]
                checkpoints.set_keep_reasons(c, {ckpt_id: f"{retention.AGENT_KEPT}{why}"})
            return False
        if kind == "event":
            _text(rec["type"], "type", 64)
            _text(rec.get("message", ""), "message", 4000)
            if len(json.dumps(rec.get("data") or {})) > 64 * 1024:
                raise ValueError("an event's 'data' holds at most 64 KiB as JSON")
            events.add(c, str(rec["type"]), str(rec.get("message", "")),
                       severity=rec.get("severity", "info"), run_id=rec.get("run_id"),
                       job_id=rec.get("job_id"), node=node, data=rec.get("data"), ts=ts)
            return False
        raise ValueError(f"unknown record kind {kind!r}")

    # -- reconciliation -----------------------------------------------------------------

    def reconcile(self, node, msg):
        """After a (re)connect and a drained outbox: compare what the agent runs with what
        the server believes. Returns the commands to send."""
        try:
            running = {(_id(r["job_id"]), _id(r["attempt"])) for r in msg.get("running", [])}
            known = {(_id(a), _id(b)) for a, b in msg.get("known", [])}
        except (KeyError, TypeError, ValueError):
            raise _protocol("sync needs 'running' [{job_id, attempt}] and 'known' "
                            "[[job_id, attempt]]") from None
        known |= running
        commands = []
        with self.lifecycle.transaction() as t:
            for job in jobs.active(self.db, node):
                key = (job["id"], job["attempt"])
                if key in known and key not in running:
                    # Known and not running: its EXITED was acked before this sync, yet
                    # the job is still active here, so that commit was lost (a power cut
                    # after the ack). Its exit status is gone with it: lost, retried.
                    log.warning("node %s: job %d attempt %d ended but its exit record was "
                                "lost; declaring it lost", node, *key)
                    self.lifecycle.finished(job["id"], job["attempt"], failure_kind="LOST",
                                            message=f"node {node} reported it ended, but "
                                            "its exit record was lost", t=t)
                    continue
                if key in known:
                    continue
                if job["state"] == states.DISPATCHED:
                    log.info("node %s never got job %d attempt %d; sending it again",
                             node, *key)
                    # A fresh ingest token for the same run: the first one's secret is
                    # not stored.
                    _, secret = tokens.add(t.conn, f"run {job['run_id']}", "ingest",
                                           run_id=job["run_id"])
                    commands.append(self.start_message(job, secret))
                else:
                    log.warning("node %s does not know running job %d attempt %d: lost",
                                node, *key)
                    self.lifecycle.finished(job["id"], job["attempt"], failure_kind="LOST",
                                            message=f"node {node} restarted without it", t=t)
            for job_id, attempt in sorted(running):
                job = jobs.get(self.db, job_id)
                if (job is None or job["node"] != node or job["attempt"] != attempt
                        or job["state"] not in jobs.ACTIVE):
                    log.warning("node %s runs stale job %d attempt %d; stopping it",
                                node, job_id, attempt)
                    commands.append(cancel_message(job_id, attempt))
            self.lifecycle.node_synced(node, t=t)
        return commands


def _int_or_none(v):
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _slurm_id(v):
    """A Slurm job id as the agent reports it ("123", "123_4" for an array task)."""
    if v is None:
        return None
    v = str(v)
    if not v or len(v) > 64 or not all(c.isdigit() or c in "_+" for c in v):
        raise ValueError(f"{v[:70]!r} is not a Slurm job id")
    return v


def cancel_message(job_id, attempt, warn=None):
    msg = {"type": "cancel", "job_id": job_id, "attempt": attempt}
    if warn:
        msg["warn"] = list(warn)        # [signal name, seconds before the stop]
    return msg


MAX_GPUS = 64            # GPUs a node may report (hello, node_stats)
MAX_STAT_FIELDS = 64     # fields of one GPU's readings, or of the host's
MAX_STAT_TEXT = 256      # characters of one text reading (a GPU's name, uuid)


def _flat_problem(d, what, max_fields):
    """Why `d` is not a flat object of readings (numbers, text, true/false, null), or None:
    what the dashboard and /nodes show must never be a shape they cannot render."""
    if not isinstance(d, dict):
        return f"{what} must be an object"
    if len(d) > max_fields:
        return f"{what} has {len(d)} fields; at most {max_fields}"
    for k, v in d.items():
        if len(k) > 64:
            return f"{what} has a field name over 64 characters"
        if v is None or isinstance(v, (bool, int, float)):
            if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
                return f"{what}.{k[:40]} is out of range"
            if isinstance(v, float) and not math.isfinite(v):
                return f"{what}.{k[:40]} must be a finite number (or null)"
            continue
        if isinstance(v, str) and len(v) <= MAX_STAT_TEXT and "\0" not in v:
            continue
        return (f"{what}.{k[:40]} must be a number, true/false, null or text of at most "
                f"{MAX_STAT_TEXT} characters")
    return None


def gpu_list_problem(gpus):
    """Why a list of GPUs (hello's inventory, node_stats' readings) does not fit the
    protocol (docs/protocol.md), or None."""
    if not isinstance(gpus, list):
        return "'gpus' must be a list of objects"
    if len(gpus) > MAX_GPUS:
        return f"'gpus' lists {len(gpus)} GPUs; at most {MAX_GPUS}"
    seen = set()
    for gpu in gpus:
        why = _flat_problem(gpu, "a GPU", MAX_STAT_FIELDS)
        if why:
            return why
        i = gpu.get("index")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < 4096 or i in seen:
            return "each GPU needs its own integer 'index' from 0 to 4095"
        seen.add(i)
    return None


def _text(v, what, max_len):
    """A string of a record that may reach an event hook's environment: refused (the record
    skipped as malformed) unless it is text of at most max_len characters without NUL."""
    if not isinstance(v, str) or len(v) > max_len or "\0" in v:
        raise ValueError(f"'{what}' must be a string of at most {max_len} characters "
                         "without a NUL byte")
    v.encode("utf-8")       # a lone surrogate: UnicodeEncodeError, a ValueError


def _agent_points(points):
    """An agent's metrics record ([[key, step, value, ts], ...]) in the wire format's
    keys-and-indexes shape; a point that is not a 4-item list stays one for the wire
    check to refuse on its own."""
    if not isinstance(points, list):
        raise metricwire.BadBatch("'points' must be a list of [key, step, value, ts] lists")
    index, out = {}, []
    for p in points:
        if isinstance(p, list) and len(p) == 4:
            k = p[0] if isinstance(p[0], str) else str(p[0])
            i = index.get(k)
            if i is None:
                i = index[k] = len(index)
            out.append([i, p[1], p[2], p[3]])
        else:
            out.append(p)
    return list(index), out


def _id(v):
    i = int(v)
    if not 0 <= i < 2**63:
        raise ValueError(f"{v!r} is not an id")
    return i


def _protocol(message, code=CLOSE_PROTOCOL):
    e = ProtocolError(message)
    e.code = code
    return e


CLOSE_LINGER_S = 1.0


def _close(ws, code, reason):
    try:
        ws.close(code, reason[:120])
    except Exception:
        return
    # An agent sends its hello without waiting; if that frame reaches a socket we have
    # already closed, the kernel answers with a reset that can destroy our close frame
    # in the agent's buffer, and it sees 1005 instead of the code (4401 means "your
    # token", which it must tell from a network failure). The reader thread closes the
    # socket once it has read what the peer sent: give it a moment to.
    thread = getattr(ws, "thread", None)
    if thread is not None:
        thread.join(CLOSE_LINGER_S)
