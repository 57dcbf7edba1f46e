"""Sweeps: create, list, show, cancel, retry-failed (docs/sweeps.md).

  POST /sweeps                      create (the spec of docs/sweeps.md, as JSON)
  GET  /sweeps?state=               newest first, with trial counts
  GET  /sweeps/<id>                 the sweep, its trials (parameters, state, the decisive
                                    value), the best so far, stopped and why
  POST /sweeps/<id>/cancel          launch no more trials; cancel the active ones
  POST /sweeps/<id>/retry-failed    run the failed or lost trials again, same parameters
  (the recommendation across a sweep: GET /checkpoints:recommend?sweep=<id>)
"""
from flask import Blueprint, current_app

from .. import lifecycle, metricwire, series as planner, states, sweeps, vocab
from ..auth import requires
from ..db import jobs, metrics, sweeps as sweeps_db
from ..errors import BadRequest, Conflict, NotFound
from .jobs import parse_job_spec
from .validate import body, query_int, query_state
from . import current_db, current_lifecycle

bp = Blueprint("sweeps", __name__, url_prefix="/api/v1")

STATES = states.SWEEP_STATES
JOB_FIELDS = ("working_dir", "gpus", "cpu_only", "priority", "max_attempts", "env",
              "tb_dir", "watch_dir", "image", "eval_command", "retention", "time_limit",
              "time_limit_s", "time_limit_min", "time_signal", "preemptible", "stop_on")
# A trial that diverges or goes NaN is ended at once unless the sweep says otherwise
# (stop_on = [] keeps them running).
TRIAL_STOP_ON = ("LOSS_NAN", "LOSS_DIVERGED")


def _sweep_or_404(sweep_id):
    sweep = sweeps_db.get(current_db(), sweep_id)
    if sweep is None:
        raise NotFound(f"sweep {sweep_id} does not exist; list sweeps with "
                       "`gpuplane sweep list`")
    return sweep


def _wake():
    sweeper = current_app.config.get("SWEEPER")
    if sweeper is not None:
        sweeper.wake()


@bp.post("/sweeps")
@requires("write")
def create():
    data = body()
    try:
        spec, params = sweeps.parse_spec(data)
    except sweeps.SweepError as e:
        raise BadRequest(str(e)) from None
    job_data = {k: data[k] for k in JOB_FIELDS if k in data}
    if "max_attempts" not in job_data:
        job_data["max_attempts"] = 1       # a trial that fails is re-run by retry-failed
    if job_data.get("stop_on") is None:
        job_data["stop_on"] = list(TRIAL_STOP_ON)
    if job_data.get("preemptible") is None:
        job_data["preemptible"] = True     # a trial resumes from its checkpoint when stopped
    sample = sweeps.fill(spec["template"], {**params[0], "trial": 0, "sweep_id": 0})
    # the folders may name the trial and the parameters too (filled per trial)
    job = parse_job_spec({**job_data, "command": sample, "name": "trial"},
                         placeholder_names=(*sweeps.RESERVED, *params[0]))
    project = (data.get("project") or "default") if isinstance(data.get("project"),
                                                                 (str, type(None))) else None
    experiment = data.get("experiment") or ""
    if project is None or not isinstance(experiment, str) or len(project) > 200 \
            or len(experiment) > 200:
        raise BadRequest("'project' and 'experiment' must be names (strings of at most 200 "
                         "characters)")
    db = current_db()
    try:
        with db.read() as conn:
            lifecycle.apply_project_defaults(conn, dict(job, project=project))
    except lifecycle.LimitRefused as e:
        raise BadRequest(str(e)) from None
    key, d, _ = sweeps.resolve_metric(db, spec, project, experiment)
    if spec["early_stopping"] or spec["sampler"]:
        what = "early stopping" if spec["early_stopping"] else f"sampler {spec['sampler']}"
        if key is None:
            raise BadRequest(f"{what} needs the metric that decides: give 'metric' "
                             "(metric = \"val_loss\") or define the experiment's primary "
                             "metric (`gpuplane metric set KEY --primary --experiment "
                             f"{experiment or 'NAME'}`)")
        if d not in ("min", "max"):
            raise BadRequest(f"{what} needs to know whether {key} is better low or "
                             "high: give 'direction' (min or max)")
    for k in ("name", "command", "project", "experiment"):
        job.pop(k, None)
    spec["job"] = {k: job[k] for k in ("working_dir", "gpus", "cpu_only", "priority",
                                       "max_attempts", "env", "tb_dir", "watch_dir",
                                       "image", "eval_command", "retention",
                                       "time_limit_s", "time_signal", "preemptible", "stop_on")}
    name = spec["name"] or f"{experiment or 'sweep'}"
    with current_lifecycle().transaction() as t:
        # a sampler's trials are asked at launch: their rows start without parameters
        sweep_id = sweeps_db.create(t.conn, name, project, experiment, spec,
                                    [None] * len(params) if spec["sampler"] else params)
        t.publish = True
    _wake()
    return view(sweeps_db.get(db, sweep_id)), 201


@bp.get("/sweeps")
@requires("read")
def list_sweeps():
    state = query_state(STATES)
    limit = query_int("limit", 100, min=1, max=10000)
    rows = sweeps_db.list_sweeps(current_db(), state, limit)
    out = [summary(s) for s in rows]
    # the newest few also say their best so far (a view reads every trial's metric)
    for s, row in zip(rows[:LIST_BEST], out):
        v = view(s)
        row.update(best=v["best"], best_missing=v["best_missing"])
    return {"sweeps": out}


LIST_BEST = 20


def summary(sweep):
    spec = sweep["spec"]
    return {"id": sweep["id"], "name": sweep["name"], "project": sweep["project"],
            "experiment": sweep["experiment"], "state": sweep["state"],
            "stop_reason": sweep["stop_reason"], "trials": spec.get("trials"),
            "parallel": spec.get("parallel"), "metric": spec.get("metric"),
            "sampler": spec.get("sampler"), "early_stopping": spec.get("early_stopping"),
            "trial_states": sweep.get("trial_states", {}),
            "created_at": sweep["created_at"], "ended_at": sweep["ended_at"]}


def trial_state(t):
    if t["job_id"] is None:
        return states.PENDING
    if t["retry"]:
        return states.RETRY
    if (t["stopped"] or t["job_stop_reason"]) and t["job_state"] in jobs.ACTIVE:
        return states.STOPPING
    if t["job_state"] == states.CANCELLED and t["failure_kind"] in states.STOP_REASONS:
        return t["failure_kind"]        # EARLY_STOPPED, STOPPED_ON_EVENT: not a cancel
    return t["job_state"]


def view(sweep):
    """The sweep with its trials and the best so far (what `sweep show` prints)."""
    db = current_db()
    out = summary(sweep)
    spec = sweep["spec"]
    key, d, origin = sweeps.resolve_metric(db, spec, sweep["project"], sweep["experiment"])
    out.update(template=spec["template"], parameters={**spec["grid"], **spec["random"]},
               seed=spec["seed"], job=spec.get("job"),
               metric={"key": key, "direction": d, "from": origin})
    rows, best = [], None
    for t in sweeps_db.trials(db, sweep["id"]):
        value = latest = None
        if key and t["run_id"]:
            kid = metrics.key_id(db, t["run_id"], key)
            if kid:
                s = planner.key_summary(db, kid, key, d if d in ("min", "max") else None)
                value, latest = s["best"], s["latest"]
        state = trial_state(t)
        row = {"number": t["number"], "params": t["params"], "job_id": t["job_id"],
               "state": state, "job_state": t["job_state"], "attempt": t["attempt"],
               "run_id": t["run_id"], "failure_kind": t["failure_kind"],
               "exit_code": t["exit_code"], "value": value, "latest": latest,
               "rung": t["rung"],
               # a stop that landed (a trial that ended first keeps its own end)
               "stopped": (t["job_stop_reason"] or t["stopped"])
               if state in (states.STOPPING, *states.STOP_REASONS) else None,
               "end": states.stop_label(t["job_stop_reason"]) if state in states.STOP_REASONS
               else (t["job_state"] or "").lower() or None,
               "told": t["told"],
               "started_at": t["started_at"], "ended_at": t["ended_at"]}
        rows.append(row)
        v = value and value.get("value")
        if isinstance(v, (int, float)) and d in ("min", "max") and (
                best is None or (v < best["value"] if d == "min" else v > best["value"])):
            best = {"trial": t["number"], "job_id": t["job_id"], "run_id": t["run_id"],
                    "value": v, "step": value["step"], "params": t["params"]}
    if best is not None:
        best["value"] = metricwire.encode(best["value"])
    out["trials_detail"] = rows
    out["trial_states"] = {}
    for r in rows:
        out["trial_states"][r["state"]] = out["trial_states"].get(r["state"], 0) + 1
    out["best"] = best
    sweeper = current_app.config.get("SWEEPER")
    out["study"] = (sweeper.studies.summary(sweep["id"])
                    if spec.get("sampler") and sweeper is not None else None)
    out["best_missing"] = None if best is not None else _why_no_best(db, key, d, rows)
    return out


def _why_no_best(db, key, d, rows):
    """Why the sweep has no best where trials have run: the sentence `sweep show` prints."""
    ran = [r["run_id"] for r in rows if r["run_id"]]
    if not ran:
        return None
    if key is None:
        return ("no metric decides: give the sweep a metric or define the experiment's "
                "primary one (`gpuplane metric set KEY --primary --experiment NAME`)")
    if d not in ("min", "max") and any(r["value"] for r in rows):
        return f"whether {key} is better low or high is unknown: give the sweep a direction"
    seen = sorted({k for run_id in ran for k in metrics.key_names(db, run_id)
                   if not vocab.is_system(k)})
    return (f"no trial logged {key}" + (f"; keys seen: {', '.join(seen[:12])}"
                                        + (" ..." if len(seen) > 12 else "") if seen
                                        else "; no trial logged any metric yet"))


@bp.get("/sweeps/<int:sweep_id>")
@requires("read")
def show(sweep_id):
    return view(_sweep_or_404(sweep_id))


@bp.post("/sweeps/<int:sweep_id>/cancel")
@requires("write")
def cancel(sweep_id):
    sweep = _sweep_or_404(sweep_id)
    if sweep["state"] in ("DONE", "CANCELLED"):
        raise Conflict(f"sweep {sweep_id} already ended ({sweep['state']}); nothing to cancel")
    lc = current_lifecycle()
    with lc.transaction() as t:
        sweeps_db.set_state(t.conn, sweep_id, "CANCELLED", "cancelled by hand")
        for trial in sweeps_db.trials(current_db(), sweep_id):
            if trial["job_state"] in ("QUEUED",) + jobs.ACTIVE:
                lc.cancel(trial["job_id"], t=t)
    return view(sweeps_db.get(current_db(), sweep_id))


@bp.post("/sweeps/<int:sweep_id>/retry-failed")
@requires("write")
def retry_failed(sweep_id):
    sweep = _sweep_or_404(sweep_id)
    if sweep["state"] == "CANCELLED":
        raise Conflict(f"sweep {sweep_id} was cancelled; create a new sweep to run it again")
    failed = [t for t in sweeps_db.trials(current_db(), sweep_id)
              if t["job_state"] == "FAILED" and not t["retry"]]
    if not failed:
        raise Conflict(f"sweep {sweep_id} has no failed or lost trial to run again")
    with current_lifecycle().transaction() as t:
        for trial in failed:
            sweeps_db.set_trial_retry(t.conn, trial["id"], True)
        sweeps_db.set_state(t.conn, sweep_id, "RUNNING")
        t.publish = True
    _wake()
    out = view(sweeps_db.get(current_db(), sweep_id))
    out["retried"] = [t["number"] for t in failed]
    return out
