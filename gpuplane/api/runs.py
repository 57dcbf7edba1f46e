"""Runs: list and show; SDK registration, finish and events (checkpoints: api/checkpoints.py)."""

from flask import Blueprint, current_app, request

from .. import recommend, states
from ..auth import requires
from ..db import dumps, events, now_ms, runs
from ..errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from .validate import body, field, opt_number, query_int
from . import current_db, current_lifecycle

bp = Blueprint("runs", __name__, url_prefix="/api/v1")

MAX_EVENT_DATA_BYTES = 64 * 1024


def run_or_404(run_id):
    run = runs.get(current_db(), run_id)
    if run is None:
        raise NotFound(f"run {run_id} does not exist; list runs with `gpuplane run list`")
    return run


def writable_run(run_id):
    """A run that takes writes: a job's run stops at its attempt's end (what the job
    wrote is in by then, and its ingest token is revoked)."""
    run = run_or_404(run_id)
    if run["source"] == "job" and run["state"] in runs.FINAL_STATES:
        raise Conflict(f"run {run_id} is job {run['job_id']} attempt {run['attempt']}, which "
                       f"ended ({run['state']}); it takes no more writes. Log to a new run "
                       "(register one with POST /api/v1/runs)")
    return run


@bp.post("/runs")
@requires("write")
def register():
    data = body()
    config = field(data, "config", dict, {})
    if len(dumps(config)) > 1_000_000:
        raise BadRequest("'config' is larger than 1 MB; log big things as files")
    source = field(data, "source", str, "sdk", choices=("sdk", "import"))
    run_id = current_lifecycle().register_run(
        source=source,
        project=field(data, "project", str, "default", max_len=200) or "default",
        experiment=field(data, "experiment", str, "", max_len=200),
        name=field(data, "name", str, "", max_len=200), config=config)
    return runs.get(current_db(), run_id), 201


@bp.get("/runs")
@requires("read")
def list_runs():
    job_id = request.args.get("job_id")
    if job_id is not None:
        try:
            job_id = int(job_id)
        except ValueError:
            job_id = -1
        if not 0 <= job_id < 2**63:      # SQLite holds no larger integer
            raise BadRequest("'job_id' must be a job's number")
    kind = request.args.get("kind")
    if kind is not None:
        kind = kind.upper()
        if kind not in ("TRAIN", "EVALUATE"):
            raise BadRequest(f"'kind' must be TRAIN or EVALUATE, got {kind[:40]!r}")
    rs = runs.list_runs(
        current_db(), project=request.args.get("project"), experiment=request.args.get("experiment"),
        job_id=job_id, state=request.args.get("state"), kind=kind,
        limit=query_int("limit", 100, min=1, max=10000))
    if query_int("best_evaluation", 0, min=0, max=1):
        # each training run's best evaluated checkpoint by the metric (?key=, else the
        # scope's primary one)
        rs = recommend.with_best_evaluation(current_db(), rs, request.args.get("key") or None)
    return {"runs": rs}


@bp.get("/runs/<int:run_id>")
@requires("read")
def show(run_id):
    return run_or_404(run_id)


@bp.post("/runs/<int:run_id>/init")
@requires("run")
def sdk_init(run_id):
    """`run.init(project=, experiment=, name=, config=)` inside a job: merged into the
    job's run where the job did not say otherwise (docs/sdk.md)."""
    run_or_404(run_id)
    data = body()
    config = field(data, "config", dict, None, nullable=True)
    if config is not None and len(dumps(config)) > 1_000_000:
        raise BadRequest("'config' is larger than 1 MB; log big things as files")
    with current_db().tx() as c:
        runs.adopt_sdk_init(
            c, run_id, config=config,
            project=field(data, "project", str, None, max_len=200, nullable=True),
            experiment=field(data, "experiment", str, None, max_len=200, nullable=True),
            name=field(data, "name", str, None, max_len=200, nullable=True))
    return runs.get(current_db(), run_id)


@bp.post("/runs/<int:run_id>/finish")
@requires("run")
def finish(run_id):
    run = run_or_404(run_id)
    status = field(body(), "status", str, states.SUCCEEDED, choices=states.RUN_FINAL)
    if run["source"] != "job":      # a job's outcome is what its agent reports
        current_lifecycle().finish_run(run_id, status)
    return runs.get(current_db(), run_id)


@bp.post("/runs/<int:run_id>/events")
@requires("run")
def add_event(run_id):
    run = writable_run(run_id)
    data = body()
    name = field(data, "name", str, max_len=200)
    payload = field(data, "data", dict, {})
    if len(dumps(payload)) > MAX_EVENT_DATA_BYTES:
        raise PayloadTooLarge(f"'data' is {len(dumps(payload))} bytes as JSON; an event "
                              f"holds at most {MAX_EVENT_DATA_BYTES} (log big things as files)")
    step = opt_number(data, "step", int)
    ts = opt_number(data, "ts", int) or now_ms()
    # debounced per run and name, a flood counted (gpuplane/events.py, docs/events.md)
    event_id, added = current_app.config["EVENTS"].record_user_event(
        run, name, payload, step, ts)
    return {"run_id": run_id, "name": name, "event_id": event_id, "new": added}, 201


@bp.get("/runs/<int:run_id>/events")
@requires("read")
def list_events(run_id):
    run_or_404(run_id)
    return {"events": events.list_events(current_db(), run_id=run_id,
                                         after_id=query_int("after", 0, min=0),
                                         limit=query_int("limit", 200, min=1, max=10000))}
