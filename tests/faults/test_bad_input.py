"""No input from a client takes the server down.

Seeded random REST requests against every route of the app's own route map (invalid JSON,
wrong types, huge strings, NaN, deep nesting, 10 MB and 17 MB bodies, odd ids and query
strings, odd methods and tokens), then hostile WebSocket frames on the agent endpoint.
Pass: no 5xx, every 4xx in the one JSON error shape, every WebSocket refusal a close with
a code (never 1011, a server error), the server up throughout and the data unchanged.
"""
import json
import os
import random
import re

import requests
from simple_websocket import Client, ConnectionClosed

from procs import route_walk

from .helpers import report, snapshot

SEED = int(os.environ.get("FAULTS_SEED", "1"))
MB = 1024 * 1024
NAN = float("nan")

# For each write route, a field whose value is always poisoned, so no generated object
# body is valid (a valid one would change the data this test promises stays unchanged).
POISON = {
    "POST /api/v1/jobs": ("command", [None, 1, 1.5, True, {}, [], [1], [""], [None], NAN, "  "]),
    "POST /api/v1/tokens": ("name", [None, 1, [], {}, "", "   ", "x" * 300, True, NAN]),
    "POST /api/v1/runs": ("config", [1, "s", [], True, NAN, 2.5]),
    "POST /api/v1/runs/<int:run_id>/finish": ("status", ["DONE", 1, [], {}, "", True, NAN]),
    "POST /api/v1/runs/<int:run_id>/checkpoints": ("path", [None, 1, [], "", {}, NAN]),
    "POST /api/v1/runs/<int:run_id>/events": ("name", [None, 1, [], {}, "x" * 300, NAN]),
    "POST /api/v1/runs/<int:run_id>/metrics": ("keys", [None, 1, "k", {}, [1], [""], NAN]),
}
# Routes where an existing id would make a valid request that changes data.
ONLY_MISSING_IDS = {"POST /api/v1/jobs/<int:job_id>/retry", "DELETE /api/v1/tokens/<int:token_id>"}
FIELDS = ["name", "command", "working_dir", "gpus", "cpu_only", "priority", "max_attempts",
          "env", "project", "experiment", "tb_dir", "watch_dir", "scope", "config", "source",
          "status", "path", "step", "epoch", "size_bytes", "data", "ts", "keys", "points"]
QUERY = ["limit", "tail", "state", "job_id", "project", "experiment", "runs", "key",
         "max_points", "from_step", "to_step", "after", "last_event_id", "x"]


def _routes():
    from gpuplane.app import create_app
    import tempfile
    with tempfile.TemporaryDirectory() as home:
        app = create_app(home, start_threads=False)
        return [(m, rule.rule, list(rule.arguments),
                 {a: type(c).__name__ for a, c in rule._converters.items()})
                for m, rule, _ in route_walk(app)
                if rule.endpoint not in ("static", "agent_ws")]


def _value(rng, depth=0):
    pick = rng.randrange(14)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -2**63 - 1, 10**30, -10**30])
    if pick == 3:
        return rng.choice([NAN, float("inf"), float("-inf"), 1e308, -0.0, 0.5])
    if pick == 4:
        return "".join(rng.choice("ab\u00e9\u2603\U0001f600 /\\\"'\n\t") for _ in range(rng.randrange(40)))
    if pick == 5:
        return "x" * rng.choice([201, 4097, 100_001, 1_000_001])
    if pick == 6:
        return "\x00\ud800"[: rng.randrange(3)]
    if pick in (7, 8) and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if pick in (9, 10) and depth < 3:
        return {rng.choice(FIELDS + ["", "\x00", "k" * 300]): _value(rng, depth + 1)
                for _ in range(rng.randrange(5))}
    return rng.choice(["NaN", "Infinity", "-Infinity", "QUEUED", "admin", "/abs", "rel"])


def _body(rng, key):
    """-> (bytes, content type, label)."""
    kind = rng.choices(["garbage", "truncated", "nonutf8", "scalar", "deep", "object",
                        "object", "object", "object", "empty", "big", "huge"],
                       weights=[4, 4, 2, 4, 2, 20, 20, 20, 20, 2, 1, 0.3])[0]
    if kind == "garbage":
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), "application/json", kind
    if kind == "truncated":
        text = json.dumps({"command": ["python", "x.py"], "working_dir": "/tmp", "keys": ["a"]})
        return text[: rng.randrange(1, len(text))].encode(), "application/json", kind
    if kind == "nonutf8":
        return b'{"name": "\xff\xfe\xfd"}', "application/json", kind
    if kind == "scalar":
        return json.dumps(rng.choice([1, "s", None, [], [1, 2], True, 1.5])).encode(), \
            "application/json", kind
    if kind == "deep":
        n = rng.choice([1000, 100_000, 1_000_000])
        return (b"[" * n + b"]" * n) if rng.random() < 0.5 else \
            (b'{"a":' * n + b"1" + b"}" * n), "application/json", kind
    if kind == "empty":
        return b"", rng.choice(["application/json", "text/plain", ""]), kind
    if kind in ("big", "huge"):
        size = 10 * MB if kind == "big" else 17 * MB
        filler = "x" * size
        obj = {"name": filler, "command": filler, "keys": [filler]}
        if key in POISON:
            field, values = POISON[key]
            obj[field] = rng.choice(values)
        return json.dumps(obj).encode(), "application/json", kind
    obj = {rng.choice(FIELDS): _value(rng) for _ in range(rng.randrange(8))}
    if key in POISON:
        field, values = POISON[key]
        obj[field] = rng.choice(values)
        if field == "keys" and rng.random() < 0.5:         # a well-formed key list, bad points
            obj.update(keys=["a"], points=rng.choice([[[1, 0, 1.0, 0]], [[0]], "p", [[0, -1, 1.0, 0]],
                                                      [[0, 0, {}, 0]], [[0, 2**64, 1.0, 0]]]))
    text = json.dumps(obj, allow_nan=True)
    ctype = rng.choice(["application/json", "application/json", "text/plain", ""])
    return text.encode("utf-8", "surrogatepass"), ctype, kind


def _id(rng, arg, existing, only_missing):
    choices = ["999999", str(2**63), str(10**30), "0", "-1", "abc", "1.5", "%00", "9" * 400]
    if not only_missing:
        choices += [str(existing.get(arg, 1))] * 4
    return rng.choice(choices)


def _path(rng, rule, args, convs, existing, only_missing):
    path = rule
    for a in args:
        conv = convs.get(a, "")
        if "Path" in conv or "String" in conv or conv == "":
            v = rng.choice(["k0", "a/b", "x" * 3000, "%2e%2e/%2e%2e", "\u2603", "NaN", "%00"])
        else:
            v = _id(rng, a, existing, only_missing)
        path = re.sub(r"<[^>]*\b%s>" % a, v, path)
    return path


def _shape_ok(resp):
    try:
        err = resp.json()["error"]
        return isinstance(err["code"], str) and isinstance(err["message"], str) and err["message"]
    except Exception:
        return False


def test_random_rest_bodies_never_5xx_and_change_nothing(live_server, faults_long):
    rng = random.Random(SEED)
    n = 10_000 if faults_long else 1_000
    api, url = live_server.api, live_server.url
    # Something to aim at: a cancelled job, a run with points, a read token.
    job = api.submit(["python", "x.py"], "/tmp", gpus=1)
    api.post(f"/api/v1/jobs/{job['id']}/cancel", expect=200)
    run = api.post("/api/v1/runs", {"name": "target"}, expect=201)
    api.post(f"/api/v1/runs/{run['id']}/metrics", {"keys": ["a"], "points": [[0, 0, 1.0, 0]]},
             expect=200)
    existing = {"job_id": job["id"], "run_id": run["id"], "token_id": 999_999}
    before = snapshot(live_server)
    routes = _routes()
    assert routes, "no routes found"

    tally = {"sent": 0, "2xx": 0, "4xx": 0, "5xx": 0, "bad_shape": 0, "cut": 0}
    fails, cuts = [], {}
    session = requests.Session()
    for i in range(n):
        method, rule, args, convs = rng.choice(routes)
        key = f"{method} {rule}"
        if rng.random() < 0.04:
            method = rng.choice(["PUT", "PATCH", "DELETE", "POST", "GET"])
        only_missing = key in ONLY_MISSING_IDS or (method != "GET" and key not in POISON)
        path = _path(rng, rule, args, convs, existing, only_missing)
        headers = {"Authorization": f"Bearer {live_server.token}"}
        if rng.random() < 0.05:
            headers["Authorization"] = rng.choice(["Bearer", "Bearer " + "x" * 10_000, "Basic x",
                                                   "bearer  " + live_server.token + " x", ""])
        params = {rng.choice(QUERY): str(_value(rng))[:3000].encode("utf-8", "surrogatepass")
                  for _ in range(rng.randrange(4))}
        if rng.random() < 0.05:
            headers["Last-Event-ID"] = rng.choice(["abc", "-1", "9" * 50, "1e3"])
        data, _kind = None, "none"
        if method in ("POST", "PUT", "PATCH", "DELETE"):
            data, ctype, _kind = _body(rng, key)
            if ctype:
                headers["Content-Type"] = ctype
        tally["sent"] += 1
        r = None
        for _try in range(2):
            try:
                r = session.request(method, url + path, params=params, data=data,
                                    headers=headers, timeout=30, stream=True)
                if r.status_code == 200 and "event-stream" in r.headers.get("Content-Type", ""):
                    r.close()           # a live stream of the (finished) job: fine
                else:
                    r.content
                break
            except requests.ConnectionError:
                # A keep-alive connection the server had closed (it does after an error
                # answered before the body was read), or a 413 closing the socket before a
                # 17 MB upload ended: try once more on a fresh connection.
                session = requests.Session()
                r = None
        if r is None:
            tally["cut"] += 1
            cuts[_kind] = cuts.get(_kind, 0) + 1
            assert requests.get(url + "/api/v1/health", timeout=10).ok, "server down"
            if _kind != "huge":
                fails.append((method, path[:120], "connection cut", _kind))
            continue
        code = r.status_code
        bucket = f"{code // 100}xx"
        tally[bucket] = tally.get(bucket, 0) + 1
        if code in (414, 431) and r.text.startswith("<html>"):
            tally["http_layer"] = tally.get("http_layer", 0) + 1   # gunicorn's own limits
        elif code >= 500:
            fails.append((method, path[:120], code, r.text[:200]))
        elif code >= 400 and not _shape_ok(r):
            tally["bad_shape"] += 1
            fails.append((method, path[:120], code, r.text[:200]))
        elif code < 300 and method != "GET" and key in POISON:
            fails.append((method, path[:120], code, "a poisoned body was accepted"))
    assert requests.get(url + "/api/v1/health", timeout=10).ok
    after = snapshot(live_server)
    report("bad-input-rest", seed=SEED, routes=len(routes), **tally,
           data_unchanged=before == after)
    print("cut connections by body kind:", cuts)
    assert not fails, f"{len(fails)} bad answers, e.g. {fails[:8]}"
    assert before == after


# -- the agent WebSocket ---------------------------------------------------------------------

def _ws(server, token=None):
    url = server.url.replace("http://", "ws://") + "/api/v1/agent/ws"
    return Client.connect(url, headers={"Authorization": f"Bearer {token or server.token}"})


def _closed_with(ws, send=(), timeout=10, until=None):
    """Send frames, then read until the server closes (or `until(replies)` holds).
    -> (close code or "open", replies)."""
    replies = []
    try:
        for frame in send:
            ws.send(frame)
        while True:
            msg = ws.receive(timeout=timeout)
            if msg is None:
                return ("open", replies)
            replies.append(json.loads(msg))
            if until is not None and until(replies):
                return ("open", replies)
    except ConnectionClosed as e:
        return (e.reason, replies)
    except OSError:                 # sent into a socket the server had already closed
        return (ws.close_reason if not ws.connected else "send failed", replies)
    finally:
        try:
            ws.close()
        except Exception:
            pass


def _hello(node="fuzz", epoch="e1", **extra):
    return json.dumps({"type": "hello", "node": node, "epoch": epoch, "gpus": [], **extra})


def test_hostile_websocket_frames_close_with_a_code(live_server, faults_long):
    rng = random.Random(SEED)
    server = live_server
    tally = {"frames": 0, "closes": {}, "1011": 0}
    failures = []

    def expect(label, frames, codes, token=None, until=None):
        ws = _ws(server, token)
        tally["frames"] += len(frames)
        code, replies = _closed_with(ws, frames, until=until)
        tally["closes"][str(code)] = tally["closes"].get(str(code), 0) + 1
        if code == 1011:
            tally["1011"] += 1
        if code not in codes:
            failures.append((label, code, replies[:3]))
        return replies

    before = snapshot(server)
    expect("wrong token", [_hello()], {4401}, token="gpa_not-a-token")
    expect("binary", [b"\x00\x01binary"], {1003})
    expect("truncated JSON", ['{"type": "hel'], {4400})
    expect("not an object", ["[1, 2]"], {4400})
    expect("no hello first", ['{"type": "batch", "records": []}'], {4400})
    expect("unknown type", [_hello(), '{"type": "launch-missiles"}'], {4400})
    expect("oversize", [_hello(), "x" * (9 * MB)], {1009})
    expect("bad hello fields", [_hello(cpu_slots="many")], {4400})
    expect("huge cpu_slots", [_hello(cpu_slots=10**30)], {4400})
    expect("node not a string", [json.dumps({"type": "hello", "node": 5, "epoch": "e"})], {4400})
    expect("gpus not objects", [_hello(gpus=[1, 2])], {4400})
    expect("batch of another epoch", [_hello(epoch="e2"),
                                     json.dumps({"type": "batch", "epoch": "zz", "records": []})],
           {4400})
    expect("sync garbage", [_hello(epoch="e3"), json.dumps({"type": "sync", "running": [{}]})],
           {4400})
    # Out-of-order seq: the server asks to resend from its cursor and applies nothing.
    replies = expect("out-of-order seq", [
        _hello(node="fuzz-seq", epoch="s1"),
        json.dumps({"type": "batch", "epoch": "s1", "records": [
            {"seq": 5, "kind": "log", "job_id": 10**6, "attempt": 1, "lines": [[1, 0, "x"]]}]}),
    ], {"open"}, until=lambda r: r[-1].get("type") == "resend")
    if {"type": "resend", "from": 1} not in replies:
        failures.append(("out-of-order seq", "no resend", replies))

    # Malformed records inside a well-formed batch are skipped (acked), never fatal.
    bad_records = [
        {"kind": "log", "job_id": "x", "attempt": 1, "lines": [[1, 0, "a"]]},
        {"kind": "log", "job_id": 10**30, "attempt": 1, "lines": [[1, 0, "a"]]},
        {"kind": "log", "job_id": 10**6, "attempt": 1, "lines": {"a": 1}},
        {"kind": "log", "job_id": 10**6, "attempt": 1, "lines": [[10**30, 0, "a"]]},
        {"kind": "job", "job_id": 10**6, "attempt": 1, "state": "RUNNING", "pid": "x"},
        {"kind": "job", "job_id": 10**6, "attempt": 1, "state": "EXITED", "exit_code": 10**30},
        {"kind": "job", "job_id": 10**6, "attempt": 1, "state": "SLEEPING"},
        {"kind": "metrics", "run_id": 10**6, "points": [["a", "b", "c", "d"]]},
        {"kind": "metrics", "run_id": "x", "points": 5},
        {"kind": "node_stats", "gpus": "lots", "host": 7},
        {"kind": "checkpoint", "run_id": 10**30, "path": "/x"},
        {"kind": "event", "type": None, "data": {"a": float("nan")}},
        {"kind": "launch"},
        {"kind": "log", "ts": "yesterday", "job_id": 10**6, "attempt": 1, "lines": []},
        {"kind": "log", "ts": 10**30, "job_id": 10**6, "attempt": 1, "lines": []},
    ]
    frames = [_hello(node="fuzz-rec", epoch="r1")]
    for i, rec in enumerate(bad_records, start=1):
        frames.append(json.dumps({"type": "batch", "epoch": "r1",
                                  "records": [dict(rec, seq=i)]}))
    replies = expect("malformed records", frames, {"open"},
                     until=lambda r: r[-1].get("seq") == len(bad_records))
    acks = [m["seq"] for m in replies if m.get("type") == "ack"]
    if acks != list(range(1, len(bad_records) + 1)):
        failures.append(("malformed records", "acks", replies))

    # Seeded random messages after a hello: whatever happens, never a server error.
    n = 400 if faults_long else 60
    for i in range(n):
        msgs = [_hello(node=f"fuzz-{i % 3}", epoch=f"rand{i}")]
        for _ in range(rng.randrange(1, 5)):
            m = {"type": rng.choice(["batch", "sync", "heartbeat", "hello", _value(rng)])}
            for _ in range(rng.randrange(4)):
                m[rng.choice(["records", "epoch", "running", "known", "seq", "node", "ts"])] = \
                    _value(rng)
            if m["type"] == "batch" and rng.random() < 0.7:
                m["epoch"] = f"rand{i}"
                m["records"] = [{"seq": rng.choice([1, 2, 0, -1, 10**30, "1"]),
                                 "kind": rng.choice(["log", "job", "metrics", "event",
                                                     "checkpoint", "node_stats", _value(rng)]),
                                 **{rng.choice(["job_id", "attempt", "lines", "run_id",
                                                "points", "state", "ts", "path", "type"]):
                                    _value(rng) for _ in range(rng.randrange(6))}}
                                for _ in range(rng.randrange(1, 4))]
            msgs.append(json.dumps(m, allow_nan=True))
        ws = _ws(server)
        tally["frames"] += len(msgs)
        code, replies = _closed_with(ws, msgs, timeout=0.5)
        tally["closes"][str(code)] = tally["closes"].get(str(code), 0) + 1
        if code == 1011 or code not in {"open", 4400, 1003, 1009, 1000, 1001, "send failed"}:
            tally["1011"] += code == 1011
            failures.append((f"random {i}", code, msgs[1:][:2]))

    assert requests.get(server.url + "/api/v1/health", timeout=10).ok
    after = snapshot(server)
    # agent records may add log lines of unknown jobs; nothing a client owns may change
    same = {k: before[k] == after[k] for k in ("jobs", "runs", "points", "tokens", "checkpoints")}
    report("bad-input-ws", seed=SEED, frames=tally["frames"], server_errors_1011=tally["1011"],
           closes=json.dumps(tally["closes"], separators=(",", ":")),
           data_unchanged=all(same.values()))
    assert not failures, failures[:10]
    assert all(same.values()), (before, after)
