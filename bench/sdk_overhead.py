"""Cost of one ``run.log({"loss": x}, step=i)`` call, beside its peers, in the same run.

Each contender runs in its own fresh process: a loop of N calls, timed, repeated (default
5 times); the figure is the median of the repetitions, in microseconds per call.

    gpuctl (local)     run.log in local mode: the sender thread writes the spool
    gpuctl (sink)      run.log in registered mode against an HTTP sink in this process
    gpuctl (sender off) run.log with the sender thread stopped: the call alone
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

The VM this runs on is noisy: ``--rounds R`` measures every contender R times, each time
in a fresh process and interleaved with the others, and quotes the median over all
repetitions. ``--baseline-sdk DIR`` adds the gpuctl contenders once more with the SDK found
in DIR (a checkout of an earlier version: ``git worktree add /tmp/base HEAD~3`` then
``--baseline-sdk /tmp/base/sdk``), so a change is measured against what it replaces in the
same run.
"""

import argparse
import http.server
import json
import os
import pathlib
import statistics
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
        if name == "gpuctl (sender off)":
            # the call alone: the floor the running sender's share is added to
            run._run.sender.stop(join_s=5)
            log = run.log
            def call(i, x):
                log({"loss": x}, step=i)
            return call, run._run.points.clear, None
        log = run.log
        def call(i, x):
            log({"loss": x}, step=i)
        def after():
            run.flush(10)
        def extra():
            s = run.summary()
            # the sender thread's CPU time, from the kernel's per-thread counters
            tid = run._run.sender.native_id
            with open("/proc/self/task/%d/stat" % tid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            sender_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return {"dropped": s["dropped"], "sent": s["sent"], "mode": s["mode"],
                    "logged": logged[0], "sender_cpu_s": sender_cpu, "loop_cpu_s": cpu[0]}
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

logged = [0]
cpu = [0.0]

def rep(count, base):
    logged[0] += count
    c = time.thread_time()
    t = time.perf_counter()
    for i in range(base, base + count):
        call(i, 0.5 + i * 1e-6)
    t = time.perf_counter() - t
    cpu[0] += time.thread_time() - c
    return t / count * 1e6

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


SUSTAINED = r'''
import json, os, sys, time
from gpuctl import run
sink, keys, step_us, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
    float(sys.argv[4])
run.init(server=sink, token="bench")
log = run.log
metrics = {"k%d" % j: 0.5 for j in range(keys)}
clock = time.perf_counter
t = clock()
n = 0
while clock() - t < seconds:
    end = clock() + step_us / 1e6
    while clock() < end:   # a training step that holds the GIL the whole time
        pass
    log(metrics)
    n += keys
elapsed = clock() - t
run.flush(30)
s = run.summary()
print(json.dumps({"rate": n / elapsed, "logged": n, "dropped": s["dropped"], "sent": s["sent"]}))
'''
# (keys per call, µs of pure-Python work per step): from a light loop to a flood
SUSTAINED_CASES = [(10, 1000), (10, 400), (10, 200), (10, 100), (50, 100)]


def sustained(python, sink, seconds):
    """Points/s a loop that never releases the GIL can log through the paced sender (in
    registered mode, against the sink) before the bounded queue starts dropping."""
    print("\nsustained logging, %g s per case, a step that holds the GIL between calls:"
          % seconds)
    print("%5s %9s %12s %10s" % ("keys", "step us", "points/s", "dropped"))
    for keys, step_us in SUSTAINED_CASES:
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
            env["GPUCTL_HOME"] = tmp
            env["PYTHONPATH"] = str(ROOT / "sdk")
            out = subprocess.run([python, "-c", SUSTAINED, sink, str(keys), str(step_us),
                                  str(seconds)], env=env, capture_output=True, text=True,
                                 timeout=300)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            print("%5d %9d  failed: %s" % (keys, step_us, out.stderr.strip()[-200:]))
            continue
        r = json.loads(lines[-1])
        print("%5d %9d %12.0f %9.1f%%" % (keys, step_us, r["rate"],
                                          100.0 * r["dropped"] / max(r["logged"], 1)))


def _count_points(body):
    """Points in a batch: the binary form the SDK sends, or JSON."""
    if body[:4] == b"GPP1":
        (hlen,) = struct.unpack_from("<I", body, 4)
        return struct.unpack_from("<I", body, 8 + hlen)[0]
    return len(json.loads(body).get("points", ()))


class _Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out as two writes; without this, Nagle plus the client's delayed
    # ACK stalls every answer ~40 ms, which no real server does
    disable_nagle_algorithm = True

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


BASELINE = " @baseline"


def measure(python, name, n, reps, sink, sdk):
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
        env["GPUCTL_HOME"] = os.path.join(tmp, "home")
        env["PYTHONPATH"] = str(sdk)
        env["WANDB_MODE"] = "offline"
        out = subprocess.run([python, "-c", CHILD, name.replace(BASELINE, ""), str(n),
                              str(reps), tmp, sink],
                             env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def combine(rounds):
    """One contender's rounds as one result: the median over every repetition."""
    good = [r for r in rounds if "median_us" in r]
    if not good:
        return rounds[0]
    reps = [x for r in good for x in r["reps"]]
    out = {"median_us": statistics.median(reps), "reps": reps, "n": good[0]["n"],
           "round_medians": [r["median_us"] for r in good]}
    if "dropped" in good[0]:
        out["dropped"] = sum(r["dropped"] for r in good)
        out["sent"] = sum(r["sent"] for r in good)
        out["logged"] = sum(r["logged"] for r in good)
        out["sender_cpu_s"] = sum(r["sender_cpu_s"] for r in good)
        out["loop_cpu_s"] = sum(r["loop_cpu_s"] for r in good)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable,
                   help="interpreter that runs every contender (a venv with the peers)")
    p.add_argument("-n", type=int, default=N, help="calls per repetition (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh processes per contender, interleaved (default %(default)s)")
    p.add_argument("--only", nargs="*", help="contenders to run (default: all)")
    p.add_argument("--baseline-sdk", metavar="DIR",
                   help="also measure gpuctl with the SDK package found in DIR")
    p.add_argument("--sustained", type=float, default=0, metavar="SECONDS",
                   help="also show the points/s a GIL-bound loop sustains without drops")
    args = p.parse_args()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sink = "http://127.0.0.1:%d" % httpd.server_address[1]

    names = ["gpuctl (local)", "gpuctl (sink)", "gpuctl (sender off)", "queue.Queue",
             "tensorboard", "mlflow", "wandb"]
    if args.only:
        names = [n for n in names if n in args.only]
    if args.baseline_sdk:
        names[2:2] = [n + BASELINE for n in names if n in ("gpuctl (local)", "gpuctl (sink)")]
    print("python: %s   calls/rep: %d   reps: %d   rounds: %d   cpus: %d"
          % (args.python, args.n, args.reps, args.rounds, os.cpu_count()))
    rounds = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            sdk = args.baseline_sdk if name.endswith(BASELINE) else ROOT / "sdk"
            rounds[name].append(measure(args.python, name, args.n, args.reps, sink, sdk))
    results = {name: combine(rs) for name, rs in rounds.items()}
    peers = [r["median_us"] for n, r in results.items()
             if "median_us" in r and not n.startswith("gpuctl")]
    cheapest = min(peers) if peers else None
    print("%-26s %10s %11s %8s  %s" % ("contender", "median us", "vs cheapest", "calls",
                                        "notes"))
    for name, r in results.items():
        if "missing" in r:
            print("%-26s %10s" % (name, "not installed"))
            continue
        if "error" in r:
            print("%-26s %10s  %s" % (name, "failed", r["error"][:60]))
            continue
        ratio = "%.2fx" % (r["median_us"] / cheapest) if cheapest else "-"
        notes = ""
        if args.rounds > 1:
            notes = "rounds " + " ".join("%.2f" % m for m in r["round_medians"]) + "  "
        if "dropped" in r:
            kept = r["logged"] - r["dropped"]
            notes += "kept %.0f%% (dropped %d, sent %d); sender CPU %.2f us/kept point, " \
                     "%.0f%% of the loop's" % (
                         100.0 * kept / r["logged"], r["dropped"], r["sent"],
                         r["sender_cpu_s"] / max(kept, 1) * 1e6,
                         100.0 * r["sender_cpu_s"] / max(r["loop_cpu_s"], 1e-9))
        print("%-26s %10.2f %11s %8d  %s" % (name, r["median_us"], ratio, r["n"], notes))
    if args.sustained:
        sustained(args.python, sink, args.sustained)
    httpd.shutdown()


if __name__ == "__main__":
    main()
