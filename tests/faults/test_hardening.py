"""Issue 22's probes from outside (docs/security.md, "Limits"; docs/reliability.md): a body
that trickles in is cut off, and what a client, a job or an agent sends is bounded, each
refusal a 4xx with the error shape while the good records around it are kept."""
import json
import os
import random
import socket
import threading
import time

import requests

from gpuplane import metricwire

from .helpers import long_mode, report, ro

SEED = int(os.environ.get("FAULTS_SEED", "1"))


def _trickler(port, token):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /api/v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + token.encode() + b"\r\nContent-Length: 100000\r\n\r\n{")
    return s


def test_a_trickling_body_is_cut_off(server_factory):
    # Before: io_timeout_s bounded each read only, so a client sending a byte a little
    # more often than that held its pool thread for ever; 4 of them froze the API.
    server = server_factory({"threads": 4, "rest_threads": 1, "agent_threads": 1,
                             "io_timeout_s": 1.5, "body_timeout_s": 2})
    clients = [_trickler(server.port, server.token) for _ in range(6)]
    stop = threading.Event()
    open_ = set(range(len(clients)))
    answers = {}

    def trickle():
        while not stop.is_set() and open_:
            for i in list(open_):
                try:
                    clients[i].sendall(b" ")
                except OSError:
                    open_.discard(i)
            stop.wait(0.4)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while open_ and time.monotonic() < deadline:
            for i in list(open_):
                c = clients[i]
                c.settimeout(0.05)
                try:
                    data = c.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    data = b""
                c.settimeout(5)             # the rest of the answer, to the server's close
                while data and not data.endswith(b"}\n") and b"}" not in data[-3:]:
                    try:
                        more = c.recv(4096)
                    except OSError:
                        break
                    if not more:
                        break
                    data += more
                answers[i] = data
                open_.discard(i)
        # (while the first 8 wait out their deadline they hold the 8 threads: a deadline
        # bounds the wait, it does not make it free)
        status_ok = server.api.get("/api/v1/status", expect=200, timeout=60) is not None
    finally:
        stop.set()
        t.join(5)
        for c in clients:
            c.close()
    timed_out = sum(1 for a in answers.values() if a.startswith(b"HTTP/1.1 408"))
    report("trickling-body", clients=len(clients), cut_off=len(answers), answered_408=timed_out)
    assert not open_, f"{len(open_)} trickling bodies still held a thread after 60 s"
    assert timed_out == len(clients), answers
    assert all(b'"RequestTimeout"' in a and b"body_timeout_s" in a for a in answers.values())
    assert status_ok


_BAD = [  # (what, a key or None for a good one, a point mangler)
    ("empty key", "", None), ("long key", "k" * 513, None), ("non-string key", 7, None),
    ("negative step", None, lambda p: [p[0], -1 - p[1], p[2], p[3]]),
    ("step past 2**63", None, lambda p: [p[0], 2**63 + p[1], p[2], p[3]]),
    ("bad value", None, lambda p: [p[0], p[1], "high", p[3]]),
    ("null value", None, lambda p: [p[0], p[1], None, p[3]]),
    ("bad ts", None, lambda p: [p[0], p[1], p[2], "now"]),
    ("short point", None, lambda p: p[:3]),
    ("index out of range", None, lambda p: [99, p[1], p[2], p[3]]),
]


def test_bad_members_never_cost_good_points(server_factory, pytestconfig):
    """Seeded batches (JSON and binary) in which about one point in ten is bad in one of
    ten ways, against a real server: every good point is stored once with its value,
    every bad one refused and counted (answers, the run's METRIC_POINTS_REFUSED events)."""
    rnd = random.Random(SEED)
    batches = 2000 if long_mode(pytestconfig) else 200
    server = server_factory()
    api = server.api
    run = api.post("/api/v1/runs", {"name": "members", "source": "sdk"}, expect=201)["id"]
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {server.token}"
    url = f"{server.url}/api/v1/runs/{run}/metrics"
    sent = refused = answered_refused = 0
    good = {}
    for b in range(batches):
        keys = ["loss", "acc"]
        points = []
        binary = b % 2 == 1
        for i in range(50):
            step = b * 50 + i
            k = i % 2
            p = [k, step, step + k / 8, 1_764_403_200_000 + step]
            if rnd.random() < 0.1:
                what, key, mangle = rnd.choice(_BAD if not binary else
                                               [x for x in _BAD if x[0] in (
                                                   "empty key", "long key", "negative step",
                                                   "index out of range")])
                if key is not None:
                    keys.append(key if not (binary and not isinstance(key, str)) else "")
                    p = [len(keys) - 1, step, 1.0, p[3]]
                elif binary and what == "negative step":
                    p = [p[0], -1 - step, p[2], p[3]]
                else:
                    p = mangle(p)
                refused += 1
            else:
                good[(keys[k], step)] = step + k / 8
            points.append(p)
        sent += len(points)
        if binary:
            # repeated names in the header are one bad key each; the binary form takes
            # only what packs (an int index and step, a float value)
            r = s.post(url, data=metricwire.encode_binary(keys, points),
                       headers={"Content-Type": metricwire.BINARY_TYPE}, timeout=30)
        else:
            r = s.post(url, data=json.dumps({"keys": keys, "points": points}),
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 200, r.text
        answered_refused += r.json().get("refused", 0)
    with ro(server) as c:
        stored = {(k, st): v for k, st, v in c.execute(
            "SELECT k.key, p.step, p.value FROM points p JOIN metric_keys k ON k.id = p.key_id"
            " WHERE k.run_id = ?", (run,))}
        keys = {r[0] for r in c.execute("SELECT key FROM metric_keys WHERE run_id = ?", (run,))}
        counted = c.execute("SELECT coalesce(sum(count), 0) FROM events WHERE run_id = ? AND"
                            " type = 'METRIC_POINTS_REFUSED'", (run,)).fetchone()[0]
    lost = sum(1 for k in good if k not in stored)
    wrong = sum(1 for k, v in good.items() if k in stored and stored[k] != v)
    report("bad-members", batches=batches, points=sent, bad=refused,
           refused=answered_refused, kept=len(stored), lost=lost, wrong=wrong,
           event_count=counted)
    assert lost == 0 and wrong == 0 and len(stored) == len(good)
    assert answered_refused == refused == counted
    assert keys == {"loss", "acc"}
