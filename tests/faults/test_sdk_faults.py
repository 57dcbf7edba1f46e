"""The SDK in a training loop against a server that is dead (connection refused), then
failing (500s), then slow (requests hang past the SDK's timeout), then fine; and a second
loop whose spool directory cannot be written. The loops finish without an exception and,
once the server answers, every point is in the server's database exactly once.

A small HTTP front in the test stands between the SDK and the real server and plays each
part; the real server behind it is never touched.
"""
import http.server
import json
import os
import socket
import subprocess
import textwrap
import threading
import time

import requests

from .helpers import PY, SDK_DIR, check_points, point_rows, report

HANG_S = 7.0                     # longer than the SDK's 5 s read timeout

TRAIN = textwrap.dedent("""
    import json, sys, time
    from gpuctl import run
    steps, keys, duration = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    t0 = time.monotonic()
    for i in range(steps):
        run.log({f"k{k}": i + k / 8 for k in range(keys)}, step=i)
        delay = t0 + duration * (i + 1) / steps - time.monotonic()
        if delay > 0.001:
            time.sleep(delay)
    loop_s = time.monotonic() - t0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and run.summary()["queued"]:
        run.flush(2.0)
        time.sleep(0.1)
    s = run.summary()
    print(json.dumps({"loop_s": round(loop_s, 2), **{k: s[k] for k in
                      ("sent", "queued", "dropped", "errors", "mode")}}), flush=True)
    run.finish()
""")


class Front:
    """An HTTP front on a fixed port: "down" (nothing listens), "500", "hang", "ok"."""

    def __init__(self, target):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.target = target
        self.mode = "down"
        self.seen = {}
        self._httpd = None

    def set(self, mode):
        self.mode = mode
        if mode != "down" and self._httpd is None:
            front = self

            class Handler(http.server.BaseHTTPRequestHandler):
                def log_message(self, *a):
                    pass

                def _any(self):
                    n = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(n) if n else b""
                    mode = front.mode
                    front.seen[mode] = front.seen.get(mode, 0) + 1
                    if mode == "hang":
                        time.sleep(HANG_S)
                        self.close_connection = True
                        return
                    if mode == "500":
                        return self._answer(500, b'{"error": {"code": "X", "message": "x"}}')
                    r = requests.request(self.command, front.target + self.path, data=body,
                                         headers={k: v for k, v in self.headers.items()
                                                  if k in ("Authorization", "Content-Type")},
                                         timeout=30)
                    self._answer(r.status_code, r.content)

                def _answer(self, code, data):
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

                do_GET = do_POST = _any

            self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
            self._httpd.daemon_threads = True
            threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self):
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()


def _train(tmp_path, name, front, run_id, token, steps, keys, duration, home):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env.update(GPUCTL_HOME=str(home), GPUCTL_SERVER=front.url, GPUCTL_RUN_ID=str(run_id),
               GPUCTL_TOKEN=token, PYTHONPATH=str(SDK_DIR), PYTHONUNBUFFERED="1")
    out = open(tmp_path / f"{name}.out", "wb")
    return subprocess.Popen([PY, str(script), str(steps), str(keys), str(duration)], env=env,
                            stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)


def test_sdk_survives_a_dead_failing_slow_server_and_an_unwritable_spool(live_server,
                                                                          tmp_path):
    api = live_server.api
    token = api.post("/api/v1/tokens", {"name": "sdk", "scope": "write"}, expect=201)["token"]
    steps, keys, duration = 3_000, 3, 12.0
    runs = {n: api.post("/api/v1/runs", {"name": n}, expect=201)["id"]
            for n in ("outage", "readonly")}
    fronts = {n: Front(live_server.url) for n in runs}
    homes = {n: tmp_path / f"home-{n}" for n in runs}
    for h in homes.values():
        h.mkdir()
    # an unwritable spool directory (a file in its place: chmod means nothing to root)
    (homes["readonly"] / "spool").write_text("not a directory")
    fronts["readonly"].set("ok")
    procs = {n: _train(tmp_path, n, fronts[n], runs[n], token, steps, keys, duration, homes[n])
             for n in runs}
    try:
        # outage: dead (connection refused), failing (500), slow (hangs), then fine
        for mode, secs in (("down", 3.0), ("500", 3.0), ("hang", HANG_S + 1), ("ok", 0)):
            fronts["outage"].set(mode)
            fronts["readonly"].set("500" if mode in ("500", "hang") else "ok")
            time.sleep(secs)                 # the fault schedule, not a wait for a condition
        rcs = {n: p.wait(150) for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in fronts.values():
            f.close()

    results = {}
    for n in runs:
        out = (tmp_path / f"{n}.out").read_text()
        summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        stored, lost, doubled, wrong = check_points(point_rows(live_server, [runs[n]]), keys,
                                                    steps)
        results[n] = dict(rc=rcs[n], traceback="Traceback" in out, summary=summary,
                          stored=stored, lost=lost, doubled=doubled, wrong=wrong,
                          front=fronts[n].seen)
        report(f"sdk-{n}", points_sent=steps * keys, points_stored=stored, points_lost=lost,
               points_doubled=doubled, exceptions=int("Traceback" in out), rc=rcs[n],
               sdk_dropped=summary.get("dropped"), loop_s=summary.get("loop_s"),
               front=json.dumps(fronts[n].seen, separators=(",", ":")))
    for n, r in results.items():
        assert r["rc"] == 0 and not r["traceback"], (n, (tmp_path / f"{n}.out").read_text()[-2000:])
        assert (r["stored"], r["lost"], r["doubled"], r["wrong"]) == (steps * keys, 0, 0, 0), (n, r)
        assert r["summary"]["dropped"] == 0 and r["summary"]["queued"] == 0, (n, r)
    assert {"500", "hang", "ok"} <= set(fronts["outage"].seen), fronts["outage"].seen
    assert {"500", "ok"} <= set(fronts["readonly"].seen), fronts["readonly"].seen
