"""Checkpoints: register, list, show, evaluate, recommend (docs/checkpoints.md).

  POST /runs/<id>/checkpoints            register (SDK; the agent's watcher uses the outbox)
  GET  /runs/<id>/checkpoints            a run's checkpoints
  GET  /checkpoints?run=&project=&experiment=
  GET  /checkpoints/<id>                 with metric values at the nearest step, evaluations
  POST /checkpoints/<id>/evaluations     queue an EVALUATE job
  GET  /checkpoints/<id>/evaluations
  GET  /evaluations/<id>
  GET  /checkpoints:recommend?experiment=&project=|run=|sweep=&key=
"""
import posixpath

from flask import Blueprint, request

from ..auth import requires
from ..db import checkpoints, jobs, projects, sweeps as sweeps_db
from ..errors import BadRequest, NotFound
from .. import evaluations, metricwire, recommend as rec
from .validate import body, field, opt_number, query_int
from . import current_db, current_lifecycle
from .runs import run_or_404 as _run_or_404, writable_run
from .jobs import time_limit

bp = Blueprint("checkpoints", __name__, url_prefix="/api/v1")


def _checkpoint_or_404(checkpoint_id):
    ckpt = checkpoints.get(current_db(), checkpoint_id)
    if ckpt is None:
        raise NotFound(f"checkpoint {checkpoint_id} does not exist; list checkpoints with "
                       "`gpuplane ckpt list`")
    return ckpt


def _encode_values(values):
    return {k: {"step": v["step"], "value": metricwire.encode(v["value"])}
            for k, v in values.items()}


def _shape(ckpt, full=False):
    db = current_db()
    out = dict(ckpt)
    if full:
        out["metrics"] = _encode_values(checkpoints.metrics_at(db, ckpt["run_id"],
                                                               ckpt["step"]))
        out["evaluations"] = [_shape_eval(e) for e in checkpoints.evaluations(db, ckpt["id"])]
    return out


def _shape_eval(e):
    e = dict(e)
    e["results"] = _encode_values(e["results"])
    return e


@bp.post("/runs/<int:run_id>/checkpoints")
@requires("run")
def register(run_id):
    run = writable_run(run_id)
    data = body()
    path = field(data, "path", str, max_len=4096)
    if not path or "\0" in path:
        raise BadRequest("'path' must be a non-empty path")
    if not posixpath.isabs(path):
        if run["job_id"]:
            # relative to the job's working dir on its host
            job = jobs.get(current_db(), run["job_id"])
            path = posixpath.join(job["working_dir"], path)
        else:
            abs_path = data.get("abs_path")
            if not isinstance(abs_path, str) or not posixpath.isabs(abs_path):
                raise BadRequest(f"run {run_id} has no job, so no working dir to resolve "
                                 f"{path!r} against; send an absolute path")
            path = abs_path
    path = posixpath.normpath(path)
    with current_db().tx() as c:
        checkpoint_id, created = checkpoints.register(
            c, run_id, path, step=opt_number(data, "step", int),
            epoch=opt_number(data, "epoch", float),
            size_bytes=opt_number(data, "size_bytes", int),
            fingerprint=field(data, "fingerprint", str, None, max_len=200, nullable=True),
            fmt=field(data, "format", str, None, max_len=40, nullable=True),
            source=field(data, "source", str, "sdk", choices=("sdk", "import")),
            # which version of the file (docs/checkpoints.md "A checkpoint is its content")
            mtime_ns=opt_number(data, "mtime_ns", int))
    out = _shape(checkpoints.get(current_db(), checkpoint_id))
    out["created"] = created
    return out, 201 if created else 200


@bp.get("/runs/<int:run_id>/checkpoints")
@requires("read")
def list_for_run(run_id):
    _run_or_404(run_id)
    # ?detail=1: each with its metrics and evaluations, as GET /checkpoints/ID has them
    # (the run page shows them all in one request)
    full = query_int("detail", 0, min=0, max=1) == 1
    return {"checkpoints": [_shape(c, full) for c in checkpoints.list_checkpoints(
        current_db(), run_id=run_id, limit=query_int("limit", 1000, min=1, max=100_000))]}


@bp.get("/checkpoints")
@requires("read")
def list_all():
    run_id = query_int("run", None, min=0)
    if run_id is not None:
        _run_or_404(run_id)
    project, experiment = _scope_names()
    return {"checkpoints": [_shape(c) for c in checkpoints.list_checkpoints(
        current_db(), run_id=run_id, project=project, experiment=experiment,
        limit=query_int("limit", 1000, min=1, max=100_000))]}


@bp.get("/checkpoints/<int:checkpoint_id>")
@requires("read")
def show(checkpoint_id):
    return _shape(_checkpoint_or_404(checkpoint_id), full=True)


@bp.post("/checkpoints/<int:checkpoint_id>/evaluations")
@requires("write")
def evaluate(checkpoint_id):
    ckpt = _checkpoint_or_404(checkpoint_id)
    data = body() if request.get_data(cache=True) else {}
    command = data.get("command")
    if command is not None and not (
            (isinstance(command, str) and command.strip())
            or (isinstance(command, list) and command
                and all(isinstance(a, str) for a in command) and command[0])):
        raise BadRequest("'command' must be an argv list of strings (or one shell string), "
                         "e.g. [\"python\", \"eval.py\"]")
    evaluation = evaluations.queue(
        current_db(), current_lifecycle(), ckpt, command=command,
        working_dir=field(data, "working_dir", str, None, max_len=4096, nullable=True),
        gpus=field(data, "gpus", int, None, min=0, max=64, nullable=True),
        cpu_only=field(data, "cpu_only", bool, None, nullable=True),
        priority=field(data, "priority", int, None, min=-1000, max=1000, nullable=True),
        time_limit_s=time_limit(data),
        preemptible=field(data, "preemptible", bool, None, nullable=True))
    return _shape_eval(evaluation), 201


@bp.get("/checkpoints/<int:checkpoint_id>/evaluations")
@requires("read")
def list_evaluations(checkpoint_id):
    _checkpoint_or_404(checkpoint_id)
    return {"evaluations": [_shape_eval(e)
                            for e in checkpoints.evaluations(current_db(), checkpoint_id)]}


@bp.get("/evaluations/<int:evaluation_id>")
@requires("read")
def show_evaluation(evaluation_id):
    e = checkpoints.get_evaluation(current_db(), evaluation_id)
    if e is None:
        raise NotFound(f"evaluation {evaluation_id} does not exist; a checkpoint lists its "
                       "evaluations: `gpuplane ckpt show ID`")
    return _shape_eval(e)


def _scope_names():
    """(project, experiment) of ?project=&experiment=; an experiment name alone must
    belong to one project."""
    db = current_db()
    project = request.args.get("project") or None
    experiment = request.args.get("experiment") or None
    if project is not None and projects.get_project(db, project) is None:
        raise NotFound(f"project {project!r} does not exist; list them with "
                       "`gpuplane project list`")
    if experiment is not None:
        if project is None:
            owners = projects.projects_with_experiment(db, experiment)
            if not owners:
                raise NotFound(f"experiment {experiment!r} does not exist in any project; "
                               "list them with `gpuplane exp list`")
            if len(owners) > 1:
                raise BadRequest(f"experiment {experiment!r} exists in projects "
                                 f"{', '.join(owners)}; add ?project= to pick one")
            project = owners[0]
        elif projects.get_experiment(db, project, experiment) is None:
            raise NotFound(f"project {project!r} has no experiment {experiment!r}; list them "
                           f"with `gpuplane exp list --project {project}`")
    return project, experiment


@bp.post("/checkpoints/<int:checkpoint_id>/pin")
@requires("write")
def pin(checkpoint_id):
    """Pin (or unpin, {"pinned": false}) a checkpoint: retention always keeps it."""
    _checkpoint_or_404(checkpoint_id)
    data = body() if request.get_data(cache=True) else {}
    checkpoints.set_pinned(current_db(), checkpoint_id, field(data, "pinned", bool, True))
    return _shape(_checkpoint_or_404(checkpoint_id))


@bp.get("/checkpoints:recommend")
@requires("read")
def recommend():
    run_id = query_int("run", None, min=0)
    sweep_id = query_int("sweep", None, min=0)
    if sweep_id is not None:
        if run_id is not None or request.args.get("project") or request.args.get("experiment"):
            raise BadRequest("give ?sweep= alone: a sweep's trials are its scope")
        sweep = sweeps_db.get(current_db(), sweep_id)
        if sweep is None:
            raise NotFound(f"sweep {sweep_id} does not exist; list sweeps with "
                           "`gpuplane sweep list`")
        return rec.recommend(current_db(), sweep=sweep, key=request.args.get("key") or None)
    project, experiment = _scope_names()
    if run_id is not None:
        if project or experiment:
            raise BadRequest("give either ?run= or ?project=/&experiment=, not both")
        _run_or_404(run_id)
    elif project is None:
        raise BadRequest("say where to choose from: ?experiment=NAME (and &project=P), "
                         "?project=P or ?run=ID")
    key = request.args.get("key") or None
    return rec.recommend(current_db(), run_id=run_id, project=project, experiment=experiment,
                         key=key)
