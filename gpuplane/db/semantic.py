"""Loading what the semantic layer (gpuplane/semantic.py) judges: plain dicts, bounded in size
whatever the run's length (summaries from the rollups, series of a few hundred buckets)."""
from .. import metricwire, series
from . import checkpoints as ckpts, events, jobs, logs, metric_defs, metrics, runs

SERIES_POINTS = 300


def key_data(db, run_id, keys=None, max_points=SERIES_POINTS):
    """Per metric key of the run: summary (count, latest, best, direction) and a
    downsampled series [[step, mean], ...]."""
    out = []
    run = runs.get(db, run_id)
    # the direction a metric definition gives a key (docs/checkpoints.md), else its name's
    defined = metric_defs.defined_directions(db, run["project"] or "",
                                             run["experiment"] or "") if run else {}
    for key_id, key in db.query("SELECT id, key FROM metric_keys WHERE run_id = ?"
                                " ORDER BY key", (run_id,)):
        if keys is not None and key not in keys:
            continue
        s = series.key_summary(db, key_id, key, defined.get(key))
        _, pts = series.series(db, key_id, max_points)
        # A bucket holding a NaN has a finite mean; its last value tells the NaN apart.
        s["points"] = [[p[0], p[3]] for p in pts]
        # the first bucket's lowest and highest logged values: where the curve started,
        # which its mean hides when the first steps differ (a loss that blows up at once)
        s["head"] = [pts[0][0], metricwire.encode(pts[0][1]), metricwire.encode(pts[0][2])] \
            if pts else None
        s["key_id"] = key_id
        out.append(s)
    return out


def run_bundle(db, run_id, keys=None):
    run = runs.get(db, run_id)
    if run is None:
        return None
    job = jobs.get(db, run["job_id"]) if run["job_id"] else None
    if job is not None:
        # what a suggestion to run it again needs (next_actions.resubmit)
        run = dict(run, job={k: job[k] for k in ("id", "command", "working_dir", "cpu_only",
                                                 "gpus", "project", "experiment", "kind")})
    return {"run": run, "keys": key_data(db, run_id, keys)}


def run_events(db, run_id, limit=200):
    return events.list_events(db, run_id=run_id, limit=limit)


def job_with_logs(db, job_id, tail=2000):
    job = jobs.get(db, job_id)
    if job is None:
        return None, [], []
    return job, logs.tail(db, job_id, tail), runs.for_job(db, job_id)


def _nearest(db, key_id, step):
    below = db.query_one("SELECT step, value FROM points WHERE key_id = ? AND step <= ?"
                         " ORDER BY step DESC LIMIT 1", (key_id, step))
    above = db.query_one("SELECT step, value FROM points WHERE key_id = ? AND step > ?"
                         " ORDER BY step LIMIT 1", (key_id, step))
    cands = [r for r in (below, above) if r is not None]
    if not cands:
        return None
    s, v = min(cands, key=lambda r: abs(r[0] - step))
    return metricwire.encode(v)


def checkpoints(db, run_ids, keys):
    """Checkpoints of the runs, each with the training value of every key in `keys` at
    the step nearest its own ({"training": {key: value}}); evaluation results where the
    schema has them."""
    out = []
    for run_id in run_ids:
        key_ids = {k: metrics.key_id(db, run_id, k) for k in keys}
        rows = db.query("SELECT id, run_id, path, step, epoch, size_bytes, created_at"
                        " FROM checkpoints WHERE run_id = ? ORDER BY step, id", (run_id,))
        for r in rows:
            c = dict(r)
            c["training"] = {}
            if c["step"] is not None:
                for k, kid in key_ids.items():
                    if kid is not None:
                        v = _nearest(db, kid, c["step"])
                        if v is not None:
                            c["training"][k] = v
            c["evaluation"] = ckpts.latest_results(db, c["id"])
            out.append(c)
    return out
