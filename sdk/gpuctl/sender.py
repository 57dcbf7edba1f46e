"""The sender thread and the few HTTP calls the SDK makes.

One daemon thread per process, ``gpuctl-sdk-sender``. Each tick it moves queued points
into batches on the spool (the order of points, checkpoints and events is kept) and, when
a server can be reached, sends what the spool holds, oldest first; new batches always queue
behind older unacknowledged ones, so a replay never comes after newer data. When its own
spool is empty it also replays spool files other processes left behind.

The thread shares the training loop's GIL. It works in batches of up to BATCH_MAX points
and, while it has a backlog, sleeps between them so that it takes at most SHARE of the
interpreter (see ``Sender._pace``): a loop that logs faster than that loses its oldest
queued points (counted in ``dropped``), never its speed.
"""

import array
import base64
import itertools
import json
import operator
import struct
import sys
import threading
import time

import requests

from . import spool as _spool

BATCH_MAX = 5000  # points per spool record and POST
SHARE = 0.1  # of the interpreter's time the sender may take while it has a backlog
INTERVAL_S = 0.5
TIMEOUT = (2.0, 5.0)  # connect, read
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
FOREIGN_SCAN_S = 30.0

OK, RETRY, DROP, DENIED = "ok", "retry", "drop", "denied"
# What a run whose process ended without finish() is finished as.
CRASHED_FINISH = json.dumps({"status": "FAILED", "reason": "the process ended without "
                             "run.finish()"})
_SEQ = operator.itemgetter(0)

_PATHS = {"metrics": "metrics", "checkpoint": "checkpoints", "event": "events",
          "finish": "finish", "init": "init",
          "config": "config"}   # "config": spool files written before "init" existed


def _session(token, server):
    s = requests.Session()
    s.headers["Authorization"] = "Bearer %s" % token
    s.headers["Content-Type"] = "application/json"
    s.headers["User-Agent"] = "gpuctl-sdk"
    try:
        # Proxy and CA-bundle settings from the environment are read once for the one
        # server this session talks to, not on every request (a quarter of requests' CPU
        # per post, taken from the training loop's interpreter).
        env = s.merge_environment_settings(server, {}, None, None, None)
        s.proxies.update(env["proxies"])
        s.verify = env["verify"]
        s.trust_env = False
    except Exception:
        pass
    return s


BINARY_TYPE = "application/x-gpuplane-points"


def _wire_head(keys_json, n):
    header = ('{"keys": %s}' % keys_json).encode()
    return b"".join([b"GPP1", struct.pack("<I", len(header)), header, struct.pack("<I", n)])


def binary_points(payload):
    """The server's binary form of a metrics batch (JSON text in the spool): b"GPP1", u32
    header length, {"keys": [...]}, u32 n, then the key_index u32, step i64, value f64 and
    ts i64 columns, little-endian. It parses several times cheaper on the server than JSON.
    None when a column does not fit (the JSON form is sent instead)."""
    try:
        body = json.loads(payload)
        if "cols" in body:      # written in column form already (see _write_metrics)
            return _wire_head(json.dumps(body["keys"]), body["n"]) + base64.b64decode(body["cols"])
        points = body["points"]
        out = [_wire_head(json.dumps(body["keys"]), len(points))]
        for code, col in zip("Iqdq", zip(*points) if points else ((),) * 4):
            a = array.array(code, col)
            if sys.byteorder != "little":
                a.byteswap()
            out.append(a.tobytes())
        return b"".join(out)
    except Exception:
        return None


def post(session, url, payload, content_type=None):
    """POST JSON text (or bytes of `content_type`); return (outcome, answer). A 2xx must
    carry a JSON object: a proxy's or captive portal's HTML page is not an acknowledgement."""
    try:
        resp = session.post(url, data=payload.encode() if isinstance(payload, str) else payload,
                            timeout=TIMEOUT,
                            headers={"Content-Type": content_type} if content_type else None)
    except Exception:
        return RETRY, None
    code = resp.status_code
    if 200 <= code < 300:
        try:
            answer = resp.json()
        except Exception:
            return RETRY, None
        return (OK, answer) if isinstance(answer, dict) else (RETRY, None)
    if code in (401, 403):
        return DENIED, None
    if code in (408, 425, 429) or code >= 500:
        return RETRY, None
    # any other 4xx will never succeed: resending it forever would block everything behind
    try:
        answer = resp.json()
    except Exception:
        answer = None
    return DROP, answer if isinstance(answer, dict) else None


def register(server, token, info, session=None):
    """Create a source=sdk run; return (run_id or None, outcome)."""
    body = json.dumps({"project": info.get("project") or "default",
                       "experiment": info.get("experiment") or "",
                       "name": info.get("name") or "", "config": info.get("config"),
                       "source": "sdk"}, default=str)
    own = session is None
    session = session or _session(token, server)
    try:
        outcome, answer = post(session, "%s/api/v1/runs" % server, body)
    finally:
        if own:
            session.close()
    if outcome == OK and answer.get("id") is not None:
        return answer["id"], OK
    return None, RETRY if outcome == OK else outcome


class Sender(threading.Thread):
    def __init__(self, r):
        super().__init__(name="gpuctl-sdk-sender", daemon=True)
        self.r = r
        self._stop_flag = False
        self._lock = threading.Lock()  # the queue→spool move and spool changes
        self._expected = 0  # next seq the queue should yield; a gap is a dropped point
        self._carry = None
        self._markers = []
        self._retry_at = 0.0
        self._backoff = RETRY_MIN_S
        self._next_scan = 0.0
        self._skip = set()
        self._session = None
        self._refused_now = 0  # points of the last metrics batch the server refused

    # -- the loop -----------------------------------------------------------------------

    def run(self):
        r = self.r
        while not self._stop_flag:
            r.idle = True
            r.wake.wait(INTERVAL_S)
            r.idle = False
            r.wake.clear()
            try:
                self.tick()
            except Exception:
                r.errors += 1
        try:
            self.drain()
            self._release_markers()
            with self._lock:
                r.spool.close()
            if self._session is not None:
                self._session.close()
        except Exception:
            r.errors += 1

    def stop(self, join_s=0.5):
        self._stop_flag = True
        self.r.wake.set()
        if threading.current_thread() is not self:
            self.join(join_s)

    def tick(self):
        r = self.r
        if r.server and r.token and time.monotonic() >= self._retry_at:
            if r.mode == "local":
                self._promote()
            if r.mode != "local":
                # moves and sends batch by batch, so a long backlog is sent as it goes
                if self._send_pending() and time.monotonic() >= self._next_scan:
                    self._next_scan = time.monotonic() + FOREIGN_SCAN_S
                    self._replay_foreign()
        self._move()  # what is still queued: local mode, or the server cannot be reached
        self._release_markers()

    # -- queue → spool --------------------------------------------------------------------

    def _account(self, seq):
        if seq >= self._expected:
            self.r.dropped += seq - self._expected
            self._expected = seq + 1
        else:
            # another thread took a seq before us but queued after us: it was not lost
            self.r.dropped -= 1

    def _pace(self, start):
        """Called after each batch moved or sent, with the (thread CPU, wall) clocks read
        before it. The training loop shares this interpreter's GIL, so while this thread
        works through a backlog it sleeps until its CPU time is at most SHARE of the wall
        time since `start`; when the loop logs faster than that allows, the bounded queue
        drops its oldest points (counted) instead of the loop slowing down. A flush,
        finish or checkpoint waiting on us lifts the limit."""
        if self._stop_flag or self._markers or self.r.control:
            return
        cpu0, wall0 = start
        due = (time.thread_time() - cpu0) / SHARE - (time.monotonic() - wall0)
        if due > 0:
            wake = self.r.wake
            wake.clear()  # an old wake-up must not cut every later pause short
            if not self.r.control:  # (one queued since the check above set it before)
                wake.wait(min(due, 0.5))

    @staticmethod
    def _clocks():
        return time.thread_time(), time.monotonic()

    def _move(self):
        """Queue → spool, one batch at a time, paced."""
        while not self._stop_flag:
            start = self._clocks()
            if not self.drain(BATCH_MAX):
                return
            self._pace(start)

    def drain(self, limit=None):
        """Move what is queued into spool records, keeping points, checkpoints and events
        in the order they were logged. With only points queued, at most about `limit` of
        them. Returns whether anything moved."""
        with self._lock:
            r = self.r
            if not r.control:
                return self._points_before(None, limit)
            moved = False
            while r.control:
                moved = self._points_before(r.control[0][0]) or moved
                seq, kind, payload = r.control.popleft()
                self._account(seq)
                if kind == "flush":
                    self._markers.append(payload)
                else:
                    r.spool.append(kind, payload, 0)
                moved = True
            return self._points_before(None) or moved

    def _points_before(self, bound, limit=None):
        """Write the queued points logged before seq `bound` (all when None), at most about
        `limit`, as metrics records. Returns whether any moved."""
        points = self.r.points
        items = []
        if self._carry is not None:
            if bound is not None and self._carry[0] >= bound:
                return False
            items.append(self._carry)
            self._carry = None
        n = len(points)
        if limit is not None and n > limit:
            n = limit
        # (with a control item queued, every seq is checked: two logging threads can
        # queue their points out of seq order)
        if n and (bound is None or max(map(_SEQ, itertools.islice(points, n))) < bound):
            # the common case, in bulk: n pops in C. The deque never holds fewer than n
            # here (only this thread pops; an append to a full one adds what it drops).
            items += itertools.islice(iter(points.popleft, None), n)
        else:
            while points:  # a control item falls among them: one at a time
                item = points.popleft()
                if item[0] >= bound:
                    self._carry = item
                    break
                items.append(item)
        if not items:
            return False
        first, last = items[0][0], items[-1][0]
        if first >= self._expected and last - first == len(items) - 1:
            self.r.dropped += first - self._expected
            self._expected = last + 1
        else:
            for item in items:
                self._account(item[0])
        for i in range(0, len(items), BATCH_MAX):
            self._write_metrics(items[i:i + BATCH_MAX])
        return True

    def _write_metrics(self, batch):
        """Turn queued points into one spool record in the server's binary column form
        (base64 inside the JSON line): C-level conversions only, so the sender takes
        little GIL time from the training loop."""
        try:
            _, names, steps, values, ts = zip(*batch)
            if not set(map(type, names)) <= {str}:
                # 1 and "1" are one metric: made text before they are told apart, or the
                # batch would name "1" twice
                names = tuple(k if type(k) is str else str(k) for k in names)
            n = len(names)
            index = dict.fromkeys(names)
            if len(index) == 1:
                kidx = array.array("I", bytes(4 * n))
            else:
                for i, k in enumerate(index):
                    index[k] = i
                kidx = array.array("I", map(index.__getitem__, names))
            cols = [kidx, array.array("q", steps), array.array("d", values),
                    array.array("q", [int(t * 1000.0) for t in ts])]
        except (OverflowError, ValueError, TypeError):
            return self._write_metric_rows(batch)   # a step or value that does not fit
        if sys.byteorder != "little":
            for c in cols:
                c.byteswap()
        keys = json.dumps(list(index))
        self.r.latest.update((k, float(v)) for k, v in dict(zip(names, values)).items())
        data = b"".join([c.tobytes() for c in cols])
        # base64 needs no JSON escaping, so the line is formatted, not encoded, here
        text = '{"keys": %s, "n": %d, "cols": "%s"}' % (keys, n, base64.b64encode(data).decode())
        self.r.spool.append("metrics", text, n, wire=_wire_head(keys, n) + data)

    def _write_metric_rows(self, batch):
        keys, index, rows = [], {}, []
        add = rows.append
        for _, key, step, value, ts in batch:
            if type(key) is not str:
                key = str(key)
            i = index.get(key)
            if i is None:
                i = index[key] = len(keys)
                keys.append(key)
            if type(value) is not float:
                try:
                    value = float(value)  # an int too large for a float is skipped here
                except (OverflowError, ValueError, TypeError):
                    self.r.errors += 1
                    continue
            try:
                add([i, step, value, int(ts * 1000.0)])
            except (OverflowError, ValueError, TypeError):
                self.r.errors += 1
        if rows:
            latest, seen = self.r.latest, set()
            for i, _, value, _ in reversed(rows):  # stop once every key has its last value
                if i not in seen:
                    seen.add(i)
                    latest[keys[i]] = value
                    if len(seen) == len(keys):
                        break
            self.r.spool.append("metrics", json.dumps({"keys": keys, "points": rows}), len(rows))

    def pending_drops(self):
        """Points already pushed out of the full queue that the sender has not met yet."""
        try:
            head = self._carry or self.r.points[0]
        except IndexError:
            return 0
        ctrl = sum(1 for c in list(self.r.control) if self._expected <= c[0] < head[0])
        return max(0, head[0] - self._expected - ctrl)

    def _release_markers(self):
        markers, self._markers = self._markers, []
        for m in markers:
            m.set()

    # -- spool → server -------------------------------------------------------------------

    def _http(self):
        if self._session is None:
            self._session = _session(self.r.token, self.r.server)
        return self._session

    def _deliver(self, run_id, kind, payload, n=0):
        url = "%s/api/v1/runs/%s/%s" % (self.r.server, run_id, _PATHS[kind])
        data = None
        if kind == "metrics":
            data = payload if type(payload) is bytes else binary_points(payload)
        if data is not None:
            outcome, answer = post(self._http(), url, data, BINARY_TYPE)
        else:
            outcome, answer = post(self._http(), url, payload)
        if outcome == OK:
            self._backoff = RETRY_MIN_S
        self._refused_now = 0
        if kind == "metrics" and outcome in (OK, DROP):
            self._refused_now = self._count_refused(outcome, answer, n)
        return outcome

    def _count_refused(self, outcome, answer, n):
        """The server keeps a batch's good points and refuses its bad ones, with reasons
        (docs/api.md): counted in summary()'s "refused" and "refusals". A batch refused
        whole (every point bad, or not a batch) counts all its points."""
        r = self.r
        try:
            if outcome == OK:
                got = int(answer.get("refused") or 0)
                reasons = answer.get("refusals") or []
            else:
                got = n
                msg = ((answer or {}).get("error") or {}).get("message") or "refused"
                reasons = [{"reason": str(msg)[:300], "points": n}]
            if not got:
                return 0
            r.refused += got
            for item in reasons[:20]:
                reason = str(item.get("reason"))[:300]
                if reason in r.refusals or len(r.refusals) < 20:
                    r.refusals[reason] = r.refusals.get(reason, 0) + int(item.get("points") or 0)
            return got
        except Exception:
            r.errors += 1
            return 0

    def _failed(self):
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RETRY_MAX_S)

    def _send_pending(self):
        r, sp = self.r, self.r.spool
        while not self._stop_flag:
            start = self._clocks()
            self.drain(BATCH_MAX)
            item = sp.peek()
            if item is None:
                return True
            _, kind, payload, n = item
            outcome = self._deliver(r.run_id, kind, payload, n)
            if outcome in (RETRY, DENIED):
                self._failed()
                return False
            if outcome == DROP:
                if kind != "metrics":      # refused points are counted in "refused"
                    r.errors += 1
            elif kind == "metrics":
                r.sent += max(0, n - self._refused_now)
            with self._lock:
                sp.ack()
            self._pace(start)
        return False

    def _promote(self):
        r = self.r
        run_id, outcome = register(r.server, r.token, r.info, self._http())
        if run_id is None:
            self._failed()
            return
        self._backoff = RETRY_MIN_S
        with self._lock:
            r.run_id, r.mode = str(run_id), "registered"
            r.spool.set_run(r.run_id, r.mode)

    def _replay_foreign(self):
        for path in _spool.foreign_files(self.r.spool.path):
            if self._stop_flag or path in self._skip:
                continue
            f = _spool.ForeignSpool.open(path)
            if f is None:
                continue
            try:
                if not self._replay_file(f):
                    return
            except Exception:
                self.r.errors += 1
                self._skip.add(path)
            finally:
                f.close()

    def _replay_file(self, f):
        """Send one left-behind spool to its run. Returns False when the server stopped
        answering (stop replaying for now), True otherwise."""
        r = self.r
        target = f.state.get("run_id")
        records = f.records()
        first = next(records, None)
        header = f.header
        if not isinstance(header, dict) or header.get("t") != "run":
            if first is None and header is None:
                f.remove()  # empty or unreadable from the first byte: nothing owed
            else:
                self._skip.add(f.path)
            return True
        same_server = (header.get("server") or "").rstrip("/") == r.server
        if target is None:
            run_id = str(header.get("run_id", ""))
            if not run_id.startswith("local-"):
                if not same_server:
                    self._skip.add(f.path)
                    return True
                target = run_id
            else:
                if header.get("server") and not same_server:
                    self._skip.add(f.path)
                    return True
                target, outcome = register(r.server, r.token, header, self._http())
                if target is None:
                    if outcome == RETRY:
                        self._failed()
                        return False
                    self._skip.add(f.path)  # this token may not create runs
                    return True
                f.advance(0, run_id=target)
        finished = False
        rec = first
        while rec is not None:
            end, body = rec
            kind = body.get("t")
            finished = finished or kind == "finish"
            if kind in _PATHS:
                payload = json.dumps(body.get("body"))
                outcome = self._deliver(target, kind, payload)
                if outcome == RETRY:
                    self._failed()
                    return False
                if outcome == DENIED:
                    self._skip.add(f.path)  # our token cannot write that run
                    return True
                if outcome == DROP:
                    r.errors += 1
            f.advance(end)
            rec = next(records, None)
        if not finished and header.get("mode") != "attached":
            # Its process is gone (the file is no longer locked) and never said finish():
            # it crashed or was killed. A job's run is ended by its agent instead.
            outcome = self._deliver(target, "finish", CRASHED_FINISH)
            if outcome == RETRY:
                self._failed()
                return False
        f.remove()
        return True
