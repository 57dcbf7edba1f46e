"""Cost of one ``run.log({"loss": x}, step=i)`` call, beside its peers, in the same run.

Each contender runs in its own fresh process: a loop of N calls, timed, repeated (default
5 times); the figure is the median of the repetitions, in microseconds per call.

    gpuctl (local)     run.log in local mode: the sender thread writes the spool
    gpuctl (sink)      run.log in registered mode against an HTTP sink in this process
    queue.Queue        put() onto a queue.Queue drained by a consumer thread (baseline)
    tensorboard        tensorboard.summary.Writer.add_scalar
    mlflow             mlflow.log_metric with a local file store
    wandb              wandb.log in offline mode

The peers are not project dependencies. Give the python of a venv that has them:

    python -m venv .bench/peers-venv
    .bench/peers-venv/bin/pip install requests tensorboard mlflow wandb
    python bench/sdk_overhead.py --python .bench/peers-venv/bin/python

A peer that is not importable there is printed as "not installed". Slow peers (over
50 us/call) get fewer calls per repetition so the run stays short; N is printed.
"""

import argparse
import http.server
import json
import os
import pathlib
import subprocess
import struct
import sys
import tempfile
import threading

ROOT = pathlib.Path(__file__).resolve().parent.parent
N = 100_000
SLOW_N = 2_000

CHILD = r'''
import json, os, sys, time, statistics
name, n, reps, tmp, sink = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]

def setup():
    if name.startswith("gpuctl"):
        from gpuctl import run
        if name == "gpuctl (sink)":
            run.init(server=sink, token="bench")
        else:
            run.init()
        log = run.log
        def call(i, x):
            log({"loss": x}, step=i)
        def after():
            run.flush(10)
        def extra():
            s = run.summary()
            return {"dropped": s["dropped"], "sent": s["sent"], "mode": s["mode"]}
        return call, after, extra
    if name == "queue.Queue":
        import queue, threading
        q = queue.Queue()
        def consume():
            while q.get() is not None:
                pass
        threading.Thread(target=consume, daemon=True).start()
        put = q.put
        def call(i, x):
            put(("loss", i, x))
        return call, None, None
    if name == "tensorboard":
        from tensorboard.summary import Writer
        w = Writer(os.path.join(tmp, "tb"))
        add = w.add_scalar
        def call(i, x):
            add("loss", x, i)
        return call, w.flush, None
    if name == "mlflow":
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3 wants a database otherwise
        import mlflow
        mlflow.set_tracking_uri("file://" + os.path.join(tmp, "mlruns"))
        mlflow.start_run()
        lm = mlflow.log_metric
        def call(i, x):
            lm("loss", x, step=i)
        return call, None, None
    if name == "wandb":
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_SILENT"] = "true"
        import wandb
        r = wandb.init(mode="offline", dir=tmp, project="bench")
        def call(i, x):
            r.log({"loss": x}, step=i)
        return call, None, None
    raise SystemExit("unknown contender " + name)

try:
    call, after, extra = setup()
except ImportError as e:
    print(json.dumps({"missing": str(e)}))
    sys.exit(0)

def rep(count, base):
    t = time.perf_counter()
    for i in range(base, base + count):
        call(i, 0.5 + i * 1e-6)
    return (time.perf_counter() - t) / count * 1e6

probe = rep(min(1000, n), 0)
if probe > 50:
    n = min(n, SLOW_N)
results = []
base = 1000
for _ in range(reps):
    results.append(rep(n, base))
    base += n
    if after:
        after()
out = {"median_us": statistics.median(results), "reps": results, "n": n}
if extra:
    out.update(extra())
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)  # peers' own exit hooks (wandb sync, mlflow) are not what is measured
'''.replace("SLOW_N", str(SLOW_N))


def _count_points(body):
    """Points in a batch: the binary form the SDK sends, or JSON."""
    if body[:4] == b"GPP1":
        (hlen,) = struct.unpack_from("<I", body, 4)
        return struct.unpack_from("<I", body, 8 + hlen)[0]
    return len(json.loads(body).get("points", ()))


class _Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/api/v1/runs":
            answer = {"id": 1}
        else:
            answer = {"accepted": _count_points(body)}
        data = json.dumps(answer).encode()
        self.send_response(201 if self.path == "/api/v1/runs" else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def measure(python, name, n, reps, sink):
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
        env["GPUCTL_HOME"] = os.path.join(tmp, "home")
        env["PYTHONPATH"] = str(ROOT / "sdk")
        env["WANDB_MODE"] = "offline"
        out = subprocess.run([python, "-c", CHILD, name, str(n), str(reps), tmp, sink],
                             env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable,
                   help="interpreter that runs every contender (a venv with the peers)")
    p.add_argument("-n", type=int, default=N, help="calls per repetition (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default %(default)s)")
    p.add_argument("--only", nargs="*", help="contenders to run (default: all)")
    args = p.parse_args()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sink = "http://127.0.0.1:%d" % httpd.server_address[1]

    names = ["gpuctl (local)", "gpuctl (sink)", "queue.Queue", "tensorboard", "mlflow",
             "wandb"]
    if args.only:
        names = [n for n in names if n in args.only]
    print("python: %s   calls/rep: %d   reps: %d   cpus: %d"
          % (args.python, args.n, args.reps, os.cpu_count()))
    results = {}
    for name in names:
        r = measure(args.python, name, args.n, args.reps, sink)
        results[name] = r
    peers = [r["median_us"] for n, r in results.items()
             if "median_us" in r and not n.startswith("gpuctl")]
    cheapest = min(peers) if peers else None
    print("%-16s %12s %10s %9s  %s" % ("contender", "median us", "vs cheapest", "calls", "notes"))
    for name, r in results.items():
        if "missing" in r:
            print("%-16s %12s" % (name, "not installed"))
            continue
        if "error" in r:
            print("%-16s %12s  %s" % (name, "failed", r["error"][:60]))
            continue
        ratio = "%.2fx" % (r["median_us"] / cheapest) if cheapest else "-"
        notes = ""
        if "dropped" in r:
            notes = "dropped %d, sent %d" % (r["dropped"], r["sent"])
        print("%-16s %12.2f %10s %9d  %s" % (name, r["median_us"], ratio, r["n"], notes))
    httpd.shutdown()


if __name__ == "__main__":
    main()
