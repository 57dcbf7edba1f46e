"""Projects, experiments, metric definitions, run metadata
(docs/checkpoints.md, docs/api.md).

  GET/POST         /projects                       list (?archived=1) / create {name, description}
  GET/PATCH/DELETE /projects/<p>                   show / {name, description, archived} / delete (?archive=1)
  GET/POST         /projects/<p>/experiments
  GET/PATCH/DELETE /projects/<p>/experiments/<e>
  GET              /projects/<p>/experiments/<e>/runs   runs by best primary value
  GET              /experiments?project=
  GET/PUT/DELETE   /metric-definitions             ?project=&experiment= / {key, ...}
  PATCH            /runs/<id>                      {config (merged), tags, name}
  POST             /runs/<id>/config               the same (the SDK's attached run.init)
(GET /runs:compare is the semantic layer's, api/semantic.py; with ?key= it carries the
aligned overlay series of recommend.overlay.)
"""
import unicodedata

from flask import Blueprint, request

from ..auth import requires
from ..db import dumps, metric_defs, projects, runs
from ..errors import BadRequest, Conflict, NotFound
from .. import recommend as rec, retention, timelimit
from .validate import body, field, query_int
from . import current_db

bp = Blueprint("projects", __name__, url_prefix="/api/v1")


def _name(data, what, default=None):
    v = field(data, "name", str) if default is None else field(data, "name", str, default)
    return check_name(v, what)


def check_name(v, what):
    if not v or len(v) > 200 or "/" in v or v != v.strip() or any(
            unicodedata.category(ch).startswith("C") for ch in v):
        raise BadRequest(f"{what} name {v[:60]!r} is not usable: 1-200 characters, no '/', "
                         "no control characters, no leading or trailing spaces")
    return v


def _flag(name):
    return request.args.get(name, "").lower() in ("1", "true", "yes")


def _project_or_404(name):
    p = projects.get_project(current_db(), name)
    if p is None:
        names = [x["name"] for x in projects.list_projects(current_db(), archived=True)]
        raise NotFound(f"project {name!r} does not exist; the projects are: "
                       f"{', '.join(names[:50]) or 'none'} (create it with "
                       f"`gpuplane project create {name}`)")
    return p


def _experiment_or_404(project, name):
    _project_or_404(project)
    e = projects.get_experiment(current_db(), project, name)
    if e is None:
        names = [x["name"] for x in projects.list_experiments(current_db(), project, True)]
        raise NotFound(f"project {project!r} has no experiment {name!r}; its experiments "
                       f"are: {', '.join(names[:50]) or 'none'} (create it with "
                       f"`gpuplane exp create {name} --project {project}`)")
    return e


# -- projects ---------------------------------------------------------------------------

@bp.get("/projects")
@requires("read")
def list_projects():
    return {"projects": projects.list_projects(current_db(), archived=_flag("archived"))}


@bp.post("/projects")
@requires("write")
def create_project():
    data = body()
    name = _name(data, "project")
    try:
        p = projects.create_project(current_db(), name,
                                    field(data, "description", str, "", max_len=2000))
    except projects.Exists:
        raise Conflict(f"project {name!r} already exists") from None
    return p, 201


@bp.get("/projects/<name>")
@requires("read")
def show_project(name):
    p = _project_or_404(name)
    p["experiment_list"] = projects.list_experiments(current_db(), name, archived=True)
    return p


@bp.patch("/projects/<name>")
@requires("write")
def update_project(name):
    _project_or_404(name)
    data = body()
    limits = _scheduling_defaults(name, data)
    if limits:
        projects.set_scheduling_defaults(current_db(), name, limits)
    new = check_name(data["name"], "project") if data.get("name") is not None else None
    try:
        return projects.update_project(
            current_db(), name, new_name=new,
            description=field(data, "description", str, None, max_len=2000, nullable=True),
            archived=field(data, "archived", bool, None, nullable=True))
    except projects.Exists:
        raise Conflict(f"project {new!r} already exists; pick another name") from None


def _scheduling_defaults(name, data):
    """'time_limit' (its jobs' limit when they give none), 'max_time_limit' (the most they
    may ask for), 'preemptible' (their default): a duration such as "2h" or seconds; null
    clears one (docs/scheduling.md)."""
    out = {}
    for key, column in (("time_limit", "time_limit_s"), ("max_time_limit", "max_time_limit_s")):
        if key in data:
            try:
                out[column] = (None if data[key] is None else
                               timelimit.parse(data[key], what=f"'{key}'"))
            except timelimit.LimitError as e:
                raise BadRequest(str(e)) from None
    if "preemptible" in data:
        out["preemptible"] = field(data, "preemptible", bool, None, nullable=True)
    if out:
        with current_db().read() as conn:
            now = projects.scheduling_defaults(conn, name)
        default = out.get("time_limit_s", now["time_limit_s"])
        most = out.get("max_time_limit_s", now["max_time_limit_s"])
        if default is not None and most is not None and default > most:
            raise BadRequest(f"project {name!r}'s default time limit "
                             f"({timelimit.describe(default)}) would be above its maximum "
                             f"({timelimit.describe(most)}); lower the default or raise "
                             "the maximum")
    return out


@bp.delete("/projects/<name>")
@requires("write")
def delete_project(name):
    _project_or_404(name)
    n_runs, n_jobs = projects.usage(current_db(), name)
    if n_runs or n_jobs:
        if _flag("archive"):
            return {**projects.update_project(current_db(), name, archived=True),
                    "deleted": False}
        raise Conflict(f"project {name!r} holds {n_runs} runs and {n_jobs} jobs; archive it "
                       f"instead (DELETE ...?archive=1, `gpuplane project delete {name} "
                       "--archive`), which hides it and keeps its runs")
    projects.delete_project(current_db(), name)
    return {"name": name, "deleted": True}


# -- experiments ------------------------------------------------------------------------

@bp.get("/experiments")
@requires("read")
def list_all_experiments():
    project = request.args.get("project") or None
    if project is not None:
        _project_or_404(project)
    return {"experiments": projects.list_experiments(current_db(), project,
                                                     archived=_flag("archived"))}


@bp.get("/projects/<project>/experiments")
@requires("read")
def list_experiments(project):
    _project_or_404(project)
    return {"experiments": projects.list_experiments(current_db(), project,
                                                     archived=_flag("archived"))}


@bp.post("/projects/<project>/experiments")
@requires("write")
def create_experiment(project):
    _project_or_404(project)
    data = body()
    name = _name(data, "experiment")
    try:
        e = projects.create_experiment(current_db(), project, name,
                                       field(data, "description", str, "", max_len=2000))
    except projects.Exists:
        raise Conflict(f"project {project!r} already has an experiment {name!r}") from None
    return e, 201


@bp.get("/projects/<project>/experiments/<name>")
@requires("read")
def show_experiment(project, name):
    return _experiment_or_404(project, name)


@bp.patch("/projects/<project>/experiments/<name>")
@requires("write")
def update_experiment(project, name):
    _experiment_or_404(project, name)
    data = body()
    new = check_name(data["name"], "experiment") if data.get("name") is not None else None
    if "retention" in data:         # checkpoint retention for its jobs without their own
        try:
            policy = retention.parse_policy(data["retention"] or None)   # false: none
        except retention.PolicyError as e:
            raise BadRequest(str(e)) from None
        projects.set_experiment_retention(current_db(), project, name, policy)
    try:
        return projects.update_experiment(
            current_db(), project, name, new_name=new,
            description=field(data, "description", str, None, max_len=2000, nullable=True),
            archived=field(data, "archived", bool, None, nullable=True))
    except projects.Exists:
        raise Conflict(f"project {project!r} already has an experiment {new!r}") from None


@bp.delete("/projects/<project>/experiments/<name>")
@requires("write")
def delete_experiment(project, name):
    _experiment_or_404(project, name)
    n_runs, n_jobs = projects.usage(current_db(), project, name)
    if n_runs or n_jobs:
        if _flag("archive"):
            return {**projects.update_experiment(current_db(), project, name, archived=True),
                    "deleted": False}
        raise Conflict(f"experiment {name!r} holds {n_runs} runs and {n_jobs} jobs; archive "
                       f"it instead (DELETE ...?archive=1, `gpuplane exp delete {name} "
                       f"--project {project} --archive`)")
    projects.delete_experiment(current_db(), project, name)
    return {"project": project, "name": name, "deleted": True}


@bp.get("/projects/<project>/experiments/<name>/runs")
@requires("read")
def experiment_runs(project, name):
    _experiment_or_404(project, name)
    return rec.leaderboard(current_db(), project, name, key=request.args.get("key") or None,
                           limit=query_int("limit", 200, min=1, max=1000))


# -- metric definitions -----------------------------------------------------------------

def _def_scope(project, experiment):
    project, experiment = project or "", experiment or ""
    if experiment and not project:
        raise BadRequest("an experiment-scoped definition needs its project too")
    if experiment:
        _experiment_or_404(project, experiment)
    elif project:
        _project_or_404(project)
    return project, experiment


@bp.get("/metric-definitions")
@requires("read")
def list_definitions():
    project, experiment = _def_scope(request.args.get("project"),
                                     request.args.get("experiment"))
    db = current_db()
    defs = metric_defs.list_definitions(db, project or None, experiment)
    key, where = metric_defs.resolve_primary(db, project, experiment)
    return {"definitions": defs, "primary": {"key": key, "from": where},
            "scope": {"project": project, "experiment": experiment}}


@bp.route("/metric-definitions", methods=["PUT", "POST"])
@requires("write")
def put_definition():
    data = body()
    key = field(data, "key", str, max_len=512)
    if not key:
        raise BadRequest("'key' must be a metric name, e.g. \"eval/loss\"")
    project = field(data, "project", str, "", max_len=200) or ""
    experiment = field(data, "experiment", str, "", max_len=200) or ""
    if experiment and not project:
        raise BadRequest("an experiment-scoped definition needs its project too")
    for name, what in ((project, "project"), (experiment, "experiment")):
        if name:
            check_name(name, what)      # the scope is created if it does not exist yet
    direction = field(data, "direction", str, None, choices=("min", "max"), nullable=True)
    primary = field(data, "primary", bool, None, nullable=True)
    d = metric_defs.put(current_db(), key, project, experiment, direction=direction,
                        primary=primary,
                        description=field(data, "description", str, None, max_len=2000,
                                          nullable=True))
    d["effective_direction"], d["direction_from"] = metric_defs.resolve_direction(
        current_db(), key, project, experiment)
    return d


@bp.delete("/metric-definitions")
@requires("write")
def delete_definition():
    key = request.args.get("key")
    if not key:
        raise BadRequest("'key' is required: DELETE /api/v1/metric-definitions?key=eval/loss"
                         "[&project=P[&experiment=E]]")
    project, experiment = _def_scope(request.args.get("project"),
                                     request.args.get("experiment"))
    if not metric_defs.delete(current_db(), key, project, experiment):
        raise NotFound(f"no definition of {key!r} at this scope; list them with "
                       "`gpuplane metric list`")
    return {"key": key, "project": project, "experiment": experiment, "deleted": True}


# -- runs: metadata and comparison --------------------------------------------------------

@bp.patch("/runs/<int:run_id>")
@bp.post("/runs/<int:run_id>/config")      # the SDK's path (it only POSTs)
@requires("run")
def update_run(run_id):
    if runs.get(current_db(), run_id) is None:
        raise NotFound(f"run {run_id} does not exist; list runs with `gpuplane run list`")
    data = body()
    config = field(data, "config", dict, None, nullable=True)
    if config is not None and len(dumps(config)) > 1_000_000:
        raise BadRequest("'config' is larger than 1 MB; log big things as files")
    tags = field(data, "tags", list, None, nullable=True)
    if tags is not None and (len(tags) > 100 or not all(
            isinstance(t, str) and 0 < len(t) <= 100 for t in tags)):
        raise BadRequest("'tags' must be a list of at most 100 strings of 1-100 characters")
    with current_db().tx() as c:
        runs.update_meta(c, run_id, config=config, tags=tags,
                         name=field(data, "name", str, None, max_len=200, nullable=True))
    return runs.get(current_db(), run_id)
