"""GPUPlane's judgements scored on REAL training runs (bench/data/real_runs.json.gz).

Every run of the corpus (bench/real_corpus.py: small torch models trained on CPU, labelled
by construction) goes the way a run goes through the server: its points are stored in a
real SQLite database in batches (gpuplane/db/metrics.py), each batch handed to the real
event engine (gpuplane/events.py: its classification of keys, its rule objects, its
debounce), the rollups built (gpuplane/rollup.py); then what an agent asks for is read
back exactly as the routes read it: the run's events, `key_data` and `diagnose_run` (GET
/runs/<id>/diagnosis), and the per-key `trend` (GET /runs/<id>/metrics, run show, the
dashboard). STALLED is scored with rules.find_stall on the run's point times, checked as
the engine checks.

Printed: per rule precision and recall (LOSS_NAN, LOSS_SPIKE, LOSS_DIVERGED,
OVERFITTING_SUSPECTED, STALLED), healthy runs warned, diagnose_run's verdict per label
and its accuracy, trend contradictions; then every miss and false alarm with the reason.

    .venv/bin/python bench/judgement.py                 # the tuning half
    .venv/bin/python bench/judgement.py --holdout       # both halves (report only)
    .venv/bin/python bench/judgement.py --holdout --fresh   # and the fresh part
    .venv/bin/python bench/judgement.py --public-only       # the public logs alone

The second corpus is published training logs that nobody here wrote
(bench/data/public_logs/corpus.json: Hugging Face trainer_state.json, Keras and Lightning
CSV logs, YOLO results.csv from public repositories, each with its source and a label read
from its numbers before any scoring). Each goes through a real server (gunicorn in a temp
home, bench/harness.py): `gpuplane import-run`'s importer sends it over REST, the server's
event engine judges its points as they arrive, and the run's events, GET
/runs/<id>/diagnosis and the per-key trends of GET /runs/<id>/metrics are read back.

The held-out half is scored only with --holdout: thresholds are set on the tuning half.
The fresh part (bench/data/real_runs_fresh.json.gz: `bench/real_corpus.py --fresh 1`, the
same generator with new seeds) was made after the held-out half had been looked at and
scored once, after the last change to the judgements. It has been looked at since (its one
false alarm drove the restart allowance); the second fresh part
(bench/data/real_runs_fresh2.json.gz: `--fresh 2`, seeds + 2000) was made then and scored
once, after that change. Each part is its own column.
"""
import argparse
import gzip
import json
import math
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuplane import rollup, rules, semantic  # noqa: E402
from gpuplane.db import Database, events as db_events, metrics, runs  # noqa: E402
from gpuplane.db import semantic as db_semantic  # noqa: E402
from gpuplane.events import Engine  # noqa: E402
from gpuplane.metricwire import parse_batch  # noqa: E402

DATA = ROOT / "bench" / "data" / "real_runs.json.gz"
PUBLIC = ROOT / "bench" / "data" / "public_logs"
FRESH = ROOT / "bench" / "data" / "real_runs_fresh.json.gz"
FRESH2 = ROOT / "bench" / "data" / "real_runs_fresh2.json.gz"
BATCH_STEPS = 50            # an SDK flush: this many steps of points per batch

# Which rule each label should raise; "also" lists rules that may fire on a label without
# counting either way (a run that blows up spikes on its way there).
RULES = ("LOSS_NAN", "LOSS_SPIKE", "LOSS_DIVERGED", "OVERFITTING_SUSPECTED", "STALLED")
EXPECTED_RULES = {"nan": {"LOSS_NAN"}, "spike": {"LOSS_SPIKE"}, "lr_burst": {"LOSS_SPIKE"},
                  "diverged": {"LOSS_DIVERGED"}, "overfit": {"OVERFITTING_SUSPECTED"},
                  "stall": {"STALLED"}, "not_learning": set(), "healthy": set()}
ALSO = {"nan": {"LOSS_SPIKE", "LOSS_DIVERGED"}, "diverged": {"LOSS_SPIKE"},
        "lr_burst": {"LOSS_DIVERGED"}}
EXPECTED_VERDICT = {"healthy": "healthy", "spike": "unstable", "lr_burst": "unstable",
                    "nan": "diverging", "diverged": "diverging", "overfit": "overfitting",
                    "not_learning": "not learning", "stall": "stalled"}
KEYS = ["train/loss", "lr", "eval/loss", "eval/acc"]


def load(path=DATA):
    with gzip.open(path, "rt") as f:
        return json.load(f)


def value(v):
    return v if not isinstance(v, str) else {"NaN": math.nan, "Infinity": math.inf,
                                             "-Infinity": -math.inf}[v]


def points_of(r, t0):
    """The run's points [[key index, step, value, ts], ...] in step order, as logged."""
    pts = []
    evals = {s: i for i, s in enumerate(r["eval_steps"])}
    for i, (v, lr, ts) in enumerate(zip(r["train_loss"], r["lr"], r["ts"])):
        step = i + 1
        t = t0 + int(ts)
        pts.append([0, step, value(v), t])
        pts.append([1, step, float(lr), t])
        j = evals.get(step)
        if j is not None:
            te = t0 + int(r["eval_ts"][j])
            pts.append([2, step, value(r["eval_loss"][j]), te])
            pts.append([3, step, value(r["eval_acc"][j]), te])
    return pts


def judge_all(corpus_runs):
    """Each run through storage, the event engine and the semantic layer; per run what
    the platform said."""
    tmp = tempfile.TemporaryDirectory(prefix="gpuplane-judgement-")
    db = Database(pathlib.Path(tmp.name) / "judge.db")
    store = metrics.MetricStore(db)
    engine = Engine(db)
    out = []
    for r in corpus_runs:
        running = r["label"] == "stall"
        with db.tx() as c:
            run_id = runs.create(c, source="sdk", state="RUNNING" if running else "SUCCEEDED",
                                 name=r["name"], config={k: r.get(k) for k in (
                                     "task", "opt", "sched", "lr", "batch", "seed")})
        run = runs.get(db, run_id)
        t0 = run["started_at"] or run["created_at"]
        pts = points_of(r, t0)
        i = 0
        while i < len(pts):
            j = i
            last_step = pts[i][1] + BATCH_STEPS
            while j < len(pts) and pts[j][1] < last_step:
                j += 1
            cols = parse_batch(KEYS, pts[i:j])
            store.ingest(run_id, KEYS, cols=cols)
            engine.offer_points(run_id, KEYS, cols)
            engine.tick()
            i = j
        rollup.roll_up(db)
        run = runs.get(db, run_id)
        if running:
            run["started_at"] = t0
        now = t0 + int(r["now_ms"]) if running else None
        evs = db_events.list_events(db, run_id=run_id, limit=200)
        keys = db_semantic.key_data(db, run_id)
        diag = semantic.diagnose_run(run, keys, evs, now_ms=now)
        activity = sorted({p[3] for p in pts})
        stall = rules.find_stall(activity, now if running else activity[-1] + 1000)
        found = {e["type"]: e for e in evs if e.get("severity") in ("warning", "critical")}
        if stall:
            found["STALLED"] = {"type": "STALLED", "message": stall["message"],
                                "step": stall["step"]}
        trends = {k["key"]: k["trend"] for k in keys}
        out.append({"run": r, "found": found, "diag": diag, "trends": trends})
    db.close() if hasattr(db, "close") else None
    tmp.cleanup()
    return out


# -- the public logs, through a real server -------------------------------------------------

PUBLIC_RULES = ("LOSS_NAN", "LOSS_SPIKE", "LOSS_DIVERGED", "OVERFITTING_SUSPECTED")
PUBLIC_EXPECTED = {"healthy": set(), "not_learning": set(), "overfit": {"OVERFITTING_SUSPECTED"},
                   "diverged": {"LOSS_DIVERGED"}, "spike": {"LOSS_SPIKE"},
                   "recovered": {"LOSS_DIVERGED"}}
PUBLIC_ALSO = {"diverged": {"LOSS_SPIKE"}, "recovered": {"LOSS_SPIKE"}}
PUBLIC_VERDICT = {"healthy": "healthy", "not_learning": "not learning",
                  "overfit": "overfitting", "diverged": "diverging", "spike": "unstable",
                  "recovered": "unstable"}
# A verdict that says nothing is wrong beside a standing warning or critical event on the
# run contradicts it (docs/events.md: the two tell one story).
CALM = ("healthy",)


def public_corpus():
    data = json.loads((PUBLIC / "corpus.json").read_text())
    return [r for r in data["runs"] if r["label"] in PUBLIC_VERDICT]


def judge_public(corpus_runs):
    """Each log imported through a real server; what the server then says of it."""
    from bench.harness import free_port, start_server, stop_server
    from gpuplane.cli import importer
    from gpuplane.client import Client
    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-public-"))
    proc, url, token = start_server(home, free_port(), threads=16)
    out = []
    try:
        client = Client(server=url, token=token, home=str(home))
        for r in corpus_runs:
            got = importer.import_dir(client, str(PUBLIC / r["file"]), project="public",
                                      name=r["id"])
            run_id = got["run_id"]
            evs = _settled_events(client, run_id)
            diag = client.get_run_diagnosis(run_id)
            keys = client.list_run_metrics(run_id)
            found = {}
            for e in evs:
                if e.get("severity") in ("warning", "critical"):
                    found.setdefault(e["type"], e)
            out.append({"run": r, "found": found, "events": evs, "diag": diag,
                        "trends": {k["key"]: k.get("trend") for k in keys}})
    finally:
        stop_server(proc)
    return out


def _settled_events(client, run_id, quiet_s=0.3, timeout_s=30):
    """The run's events once the server's engine has judged its points: the engine works on
    its own thread, so the list is read until it stops changing for `quiet_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        evs = client.list_events(run=run_id, limit=500)["events"]
        sig = [(e["id"], e.get("count")) for e in evs]
        if sig != last:
            last, since = sig, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return evs
        time.sleep(0.05)
    return evs


def public_contradictions(res):
    """A calm verdict beside a standing warning or critical event of the run."""
    bad = [t for t, e in res["found"].items() if t in PUBLIC_RULES]
    if res["diag"]["verdict"] in CALM and bad:
        return [f"verdict '{res['diag']['verdict']}' beside {', '.join(sorted(bad))}"]
    return []


def print_public(name, results, detail=True):
    n = len(results)
    healthy = [res for res in results if res["run"]["label"] == "healthy"]
    warned = [res for res in healthy if set(res["found"]) & set(PUBLIC_RULES)]
    print(f"\n== public {name}: {n} runs ({len(healthy)} healthy), from "
          f"{len({res['run']['repo'] for res in results})} repositories, kinds "
          f"{', '.join(sorted({res['run']['kind'] for res in results}))} ==")
    print(f"{'rule':24} {'TP':>3} {'FP':>3} {'FN':>3} {'precision':>9} {'recall':>7}")
    lines = []
    for rule in PUBLIC_RULES:
        tp = fp = fn = 0
        for res in results:
            label = res["run"]["label"]
            want = rule in PUBLIC_EXPECTED[label]
            got = rule in res["found"]
            if rule in PUBLIC_ALSO.get(label, ()) and not want:
                continue
            if want and got:
                tp += 1
            elif want:
                fn += 1
                lines.append(f"  MISS {rule}: {res['run']['id']}: {res['run']['why']}")
            elif got:
                fp += 1
                e = res["found"][rule]
                lines.append(f"  FALSE ALARM {rule}: {res['run']['id']}: step {e.get('step')}: "
                             f"{(e.get('message') or '')[:200]}")
        p = tp / (tp + fp) if tp + fp else float("nan")
        rc = tp / (tp + fn) if tp + fn else float("nan")
        print(f"{rule:24} {tp:3d} {fp:3d} {fn:3d} {p:9.2f} {rc:7.2f}")
    right = [res for res in results
             if res["diag"]["verdict"] == PUBLIC_VERDICT[res["run"]["label"]]]
    print(f"healthy runs warned: {len(warned)} of {len(healthy)}")
    print(f"diagnose_run right: {len(right)} of {n} ({100 * len(right) / max(1, n):.0f}%)")
    print(f"{'label':14} {'runs':>4} {'right':>5}  verdicts given")
    for lab in sorted({res["run"]["label"] for res in results}):
        rs = [res for res in results if res["run"]["label"] == lab]
        given = {}
        for res in rs:
            given[res["diag"]["verdict"]] = given.get(res["diag"]["verdict"], 0) + 1
        ok = sum(res["diag"]["verdict"] == PUBLIC_VERDICT[lab] for res in rs)
        print(f"{lab:14} {len(rs):4d} {ok:5d}  "
              + ", ".join(f"{v} {c}" for v, c in sorted(given.items())))
    contra = [(res, c) for res in results for c in public_contradictions(res)]
    print(f"verdict/event contradictions: {len(contra)}")
    if not detail:
        return
    for line in lines:
        print(line)
    for res in results:
        want = PUBLIC_VERDICT[res["run"]["label"]]
        if res["diag"]["verdict"] != want:
            print(f"  DIAGNOSE {res['run']['id']}: '{res['diag']['verdict']}' (want '{want}'): "
                  f"{(res['diag']['evidence'] or [''])[0][:200]}")
    for res, c in contra:
        print(f"  CONTRADICTION {res['run']['id']}: {c}")


# -- trend contradictions -----------------------------------------------------------------------

def _mw_z(a, b):
    """Mann-Whitney U as a z score: > 0 when b's values tend to be larger than a's."""
    n1, n2 = len(a), len(b)
    if n1 < 3 or n2 < 3:
        return 0.0
    allv = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = {}
    i = 0
    while i < len(allv):
        j = i
        while j < len(allv) and allv[j][0] == allv[i][0]:
            j += 1
        for k in range(i, j):
            ranks[k] = (i + j + 1) / 2
        i = j
    rb = sum(ranks[k] for k, (_, g) in enumerate(allv) if g == 1)
    u = rb - n2 * (n2 + 1) / 2
    mu = n1 * n2 / 2
    sd = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    return (u - mu) / sd if sd else 0.0


def contradictions(res, start_points=3):
    """Where a key's trend contradicts its raw recorded values: 'improving' while its last
    10% is far worse than where it started, or a direction that the raw last 10% (at least
    3 points) against the 10% before does not show: their medians differ the other way, a
    Mann-Whitney z beyond 2 the other way, or under 1 either way (no evidence at all); a
    curve far worse than where it started is 'worsening' whatever its last stretch does
    (issue 25: "a loss far above its first values is not improving").
    Where it started: the better of the median of its first 10% and its best of its first
    `start_points` logged points (a loss that blows up within its first 10% started at its
    first values, not at the median of the blow-up); start_points=0: the first 10%'s
    median only (the criterion of the first scoring, printed beside for comparison)."""
    r = res["run"]
    out = []
    for key, vals, d in (("train/loss", r["train_loss"], "min"),
                         ("eval/loss", r["eval_loss"], "min"),
                         ("eval/acc", r["eval_acc"], "max")):
        t = res["trends"].get(key)
        xs = [value(v) for v in vals]
        xs = [v for v in xs if math.isfinite(v)]
        if t in (None, "unknown") or len(xs) < 8:
            continue
        b = xs if d == "min" else [-v for v in xs]
        k = max(3, round(len(b) * 0.1))
        first, last, prev = b[:k], b[-k:], b[-2 * k:-k]
        origin = statistics.median(first)
        if start_points:
            origin = min(origin, min(b[:start_points]))
        far_worse = statistics.median(last) > origin + 0.5 * abs(origin)
        z = _mw_z(prev, last)            # > 0: the last window is worse
        d_med = statistics.median(last) - statistics.median(prev)
        if t == "improving" and far_worse:
            out.append(f"{key} 'improving' while its last 10% is far above its first 10%")
        elif t == "improving" and (d_med > 0 or z > 2 or abs(z) < 1):
            out.append(f"{key} 'improving' while its last 10% is not lower than the 10% "
                       f"before (Mann-Whitney z {z:.1f}, medians {d_med:+.3g})")
        elif t == "worsening" and not far_worse and (d_med < 0 or z < -2 or abs(z) < 1):
            out.append(f"{key} 'worsening' while its last 10% is not higher than the 10% "
                       f"before (Mann-Whitney z {z:.1f}, medians {d_med:+.3g})")
    return out


# -- the table ----------------------------------------------------------------------------------

def score(results):
    rows = []
    for rule in RULES:
        tp = fp = fn = 0
        misses, alarms = [], []
        for res in results:
            label = res["run"]["label"]
            want = rule in EXPECTED_RULES[label]
            got = rule in res["found"]
            if rule in ALSO.get(label, ()) and not want:
                continue
            if want and got:
                tp += 1
            elif want:
                fn += 1
                misses.append(f"{res['run']['name']} [{res['run']['half']}]: "
                              f"{res['run']['check']}")
            elif got:
                fp += 1
                e = res["found"][rule]
                alarms.append(f"{res['run']['name']} [{res['run']['half']}]: step "
                              f"{e.get('step')}: {e.get('message')}")
        p = tp / (tp + fp) if tp + fp else float("nan")
        rc = tp / (tp + fn) if tp + fn else float("nan")
        rows.append((rule, tp, fp, fn, p, rc, misses, alarms))
    healthy = [res for res in results if res["run"]["label"] == "healthy"]
    warned = [res for res in healthy if res["found"]]
    right = [res for res in results
             if res["diag"]["verdict"] == EXPECTED_VERDICT[res["run"]["label"]]]
    contra = [(res, c) for res in results for c in contradictions(res)]
    return rows, healthy, warned, right, contra


def print_half(name, results, detail=True):
    rows, healthy, warned, right, contra = score(results)
    n = len(results)
    print(f"\n== {name}: {n} runs ({len(healthy)} healthy) ==")
    print(f"{'rule':24} {'TP':>3} {'FP':>3} {'FN':>3} {'precision':>9} {'recall':>7}")
    for rule, tp, fp, fn, p, rc, _, _ in rows:
        print(f"{rule:24} {tp:3d} {fp:3d} {fn:3d} {p:9.2f} {rc:7.2f}")
    print(f"healthy runs warned: {len(warned)} of {len(healthy)}")
    print(f"diagnose_run right: {len(right)} of {n} ({100 * len(right) / max(1, n):.0f}%)")
    print(f"{'label':14} {'runs':>4} {'right':>5}  verdicts given")
    labels = sorted({res["run"]["label"] for res in results})
    for lab in labels:
        rs = [res for res in results if res["run"]["label"] == lab]
        ok = sum(res["diag"]["verdict"] == EXPECTED_VERDICT[lab] for res in rs)
        given = {}
        for res in rs:
            given[res["diag"]["verdict"]] = given.get(res["diag"]["verdict"], 0) + 1
        print(f"{lab:14} {len(rs):4d} {ok:5d}  "
              + ", ".join(f"{v} {c}" for v, c in sorted(given.items())))
    old = sum(len(contradictions(res, 0)) for res in results)
    print(f"trend contradictions: {len(contra)} (keys judged: "
          f"{sum(1 for res in results for k in ('train/loss', 'eval/loss', 'eval/acc') if res['trends'].get(k) not in (None, 'unknown'))}; "
          f"{old} with the start taken as the first 10%'s median only)")
    if not detail:
        return
    for rule, _, _, _, _, _, misses, alarms in rows:
        for m in misses:
            print(f"  MISS {rule}: {m}")
        for a in alarms:
            print(f"  FALSE ALARM {rule}: {a}")
    for res in warned:
        print(f"  HEALTHY WARNED: {res['run']['name']}: {', '.join(res['found'])}")
    for res in results:
        want = EXPECTED_VERDICT[res["run"]["label"]]
        if res["diag"]["verdict"] != want:
            print(f"  DIAGNOSE {res['run']['name']}: '{res['diag']['verdict']}' (want "
                  f"'{want}'): {(res['diag']['evidence'] or [''])[0][:220]}")
    for res, c in contra:
        print(f"  TREND {res['run']['name']}: {c}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--holdout", action="store_true",
                    help="also score the held-out half (only once tuning is done)")
    ap.add_argument("--fresh", action="store_true",
                    help=f"also score the fresh parts ({FRESH.relative_to(ROOT)}, "
                         f"{FRESH2.relative_to(ROOT)})")
    ap.add_argument("--quiet", action="store_true", help="the tables only")
    ap.add_argument("--public-only", action="store_true",
                    help="the public logs alone (bench/data/public_logs), not the real runs")
    args = ap.parse_args()
    public_halves = ["tune"] + (["holdout"] if args.holdout else [])
    pub = [r for r in public_corpus() if r["half"] in public_halves]
    t = time.perf_counter()
    pub_results = judge_public(pub)
    print(f"public logs: {PUBLIC.relative_to(ROOT)}: {len(public_corpus())} labelled runs; "
          f"judged {len(pub)} through a real server in {time.perf_counter() - t:.1f} s")
    for h in public_halves:
        print_public(h, [res for res in pub_results if res["run"]["half"] == h],
                     detail=not args.quiet)
    if args.public_only:
        return 0
    data = load(args.data)
    halves = ["tune"] + (["holdout"] if args.holdout else [])
    if args.fresh:
        for half, path in (("fresh", FRESH), ("fresh2", FRESH2)):
            fresh = load(path)
            print(f"{half} part: {path.relative_to(ROOT)}: {len(fresh['runs'])} runs "
                  f"({len(fresh.get('dropped', []))} dropped by their label checks when "
                  "made)")
            runs = [dict(r, half=half) for r in fresh["runs"]]    # each part its own column
            data = dict(data, runs=data["runs"] + runs)
            halves.append(half)
    todo = [r for r in data["runs"] if r["half"] in halves]
    t = time.perf_counter()
    results = judge_all(todo)
    wall = time.perf_counter() - t
    print(f"corpus: {args.data}: {len(data['runs'])} runs "
          f"({len(data.get('dropped', []))} dropped by their label checks when made), "
          f"torch {data.get('torch')}; judged {len(todo)} in {wall:.1f} s")
    for h in halves:
        print_half(h, [res for res in results if res["run"]["half"] == h],
                   detail=not args.quiet)
    if not args.holdout:
        print("\n(the held-out half is not scored; --holdout scores it, once tuning is done)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
