"""Runs: one per job attempt, or registered by the SDK, or imported."""
from .. import states
from ..params import split as split_params
from . import LimitExceeded, dumps, loads, now_ms, projects

FINAL_STATES = states.RUN_FINAL


def to_dict(row):
    if row is None:
        return None
    d = dict(row)
    d["config"] = loads(d["config"], {})
    d["gpu_indices"] = loads(d["gpu_indices"])
    d["tags"] = loads(d.get("tags"), [])
    # hyperparameters and bookkeeping, from its command line and config (gpuplane/params.py)
    d["params"], d["bookkeeping"] = split_params(d["config"])
    return d


def create(conn, *, source, state, project="default", experiment="", name="", config=None,
           job_id=None, attempt=None, node=None, gpu_indices=None, kind="TRAIN",
           parent_checkpoint_id=None):
    """kind: TRAIN, or EVALUATE (the run of an evaluation of parent_checkpoint_id)."""
    projects.ensure(conn, project, experiment)
    cur = conn.execute(
        "INSERT INTO runs (job_id, attempt, source, state, project, experiment, name, config,"
        " node, gpu_indices, created_at, started_at, kind, parent_checkpoint_id)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (job_id, attempt, source, state, project, experiment, name, dumps(config or {}),
         node, dumps(gpu_indices) if gpu_indices is not None else None, now_ms(),
         now_ms() if state == states.RUNNING else None, kind, parent_checkpoint_id))
    return cur.lastrowid


def get(db, run_id):
    return to_dict(db.query_one("SELECT * FROM runs WHERE id = ?", (run_id,)))


def list_runs(db, project=None, experiment=None, job_id=None, state=None, limit=100,
              kind=None):
    """Newest first; kind: only TRAIN or only EVALUATE runs."""
    where, params = [], []
    for col, val in (("project", project), ("experiment", experiment),
                     ("job_id", job_id), ("state", state), ("kind", kind)):
        if val is not None:
            where.append(f"{col} = ?")
            params.append(val)
    sql = "SELECT * FROM runs"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY id DESC LIMIT ?"
    return [to_dict(r) for r in db.query(sql, (*params, limit))]


def for_job(db, job_id):
    return [to_dict(r) for r in db.query(
        "SELECT * FROM runs WHERE job_id = ? ORDER BY attempt", (job_id,))]


def finish(conn, run_id, state, exit_code=None, failure_kind=None, ts=None):
    """Returns whether the run was still open (so this ended it)."""
    return conn.execute(
        "UPDATE runs SET state = ?, exit_code = ?, failure_kind = ?, ended_at = ?"
        " WHERE id = ? AND state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')",
        (state, exit_code, failure_kind, ts or now_ms(), run_id)).rowcount > 0


def set_slurm_job_id(conn, job_id, attempt, slurm_job_id):
    """The Slurm job an attempt became (docs/slurm.md)."""
    conn.execute("UPDATE runs SET slurm_job_id = ? WHERE job_id = ? AND attempt = ?",
                 (str(slurm_job_id), job_id, attempt))


def set_resumed_from(conn, run_id, checkpoint_id):
    conn.execute("UPDATE runs SET resumed_from = ? WHERE id = ?", (checkpoint_id, run_id))


def mark_running(conn, run_id, ts=None):
    conn.execute("UPDATE runs SET state = 'RUNNING', started_at = COALESCE(started_at, ?)"
                 " WHERE id = ? AND state = 'STARTING'", (ts or now_ms(), run_id))


def for_attempt(conn, job_id, attempt):
    row = conn.execute("SELECT * FROM runs WHERE job_id = ? AND attempt = ?",
                       (job_id, attempt)).fetchone()
    return to_dict(row)


def exists(conn, run_id):
    return conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is not None


MAX_CONFIG_BYTES = 1_000_000      # a run's config as stored, whatever merged it


def _config_text(run_id, merged):
    text = dumps(merged)
    if len(text) > MAX_CONFIG_BYTES:
        raise LimitExceeded(f"run {run_id}'s config would be {len(text)} bytes after this "
                            f"merge; a run's config holds at most {MAX_CONFIG_BYTES} bytes in "
                            "all (log big things as files)")
    return text


def update_meta(conn, run_id, *, config=None, tags=None, name=None):
    """Merge `config` into the run's config, replace its tags, rename it."""
    if config:
        row = conn.execute("SELECT config FROM runs WHERE id = ?", (run_id,)).fetchone()
        merged = {**loads(row[0], {}), **config}
        conn.execute("UPDATE runs SET config = ? WHERE id = ?",
                     (_config_text(run_id, merged), run_id))
    if tags is not None:
        conn.execute("UPDATE runs SET tags = ? WHERE id = ?", (dumps(tags), run_id))
    if name is not None:
        conn.execute("UPDATE runs SET name = ? WHERE id = ?", (name, run_id))


def adopt_sdk_init(conn, run_id, *, project=None, experiment=None, name=None, config=None):
    """What `run.init(...)` inside a job says about the job's run. The job's own settings
    win: config keys merge in only where the run has none; a project / experiment the
    submitter named stays (what run.init asked for is kept in the run's `init_wish`), and
    one the submitter left out is taken from run.init for the run and its job alike, so
    `job show`, `sweep show` and `exp runs` agree on where the run lives."""
    row = conn.execute(
        "SELECT r.project, r.experiment, r.name, r.config, r.job_id, j.project_given,"
        " j.experiment_given FROM runs r LEFT JOIN jobs j ON j.id = r.job_id"
        " WHERE r.id = ?", (run_id,)).fetchone()
    if row is None:
        return
    sets, args = [], []
    if config:
        merged = {**config, **loads(row["config"], {})}
        sets.append("config = ?")
        args.append(_config_text(run_id, merged))
    in_job = row["job_id"] is not None
    project_open = not row["project_given"] if in_job else row["project"] in (None, "", "default")
    experiment_open = not row["experiment_given"] if in_job else not row["experiment"]
    new_project = project if project and project_open and project != row["project"] else None
    new_experiment = (experiment if experiment and experiment_open
                      and experiment != row["experiment"] else None)
    wish = {k: v for k, v, open_ in (("project", project, project_open),
                                     ("experiment", experiment, experiment_open))
            if v and not open_ and v != row[k]}
    if wish:
        sets.append("init_wish = ?")
        args.append(dumps(wish))
    if new_project or new_experiment:
        projects.ensure(conn, new_project or row["project"], new_experiment or row["experiment"])
    if new_project:
        sets.append("project = ?")
        args.append(new_project)
    if new_experiment:
        sets.append("experiment = ?")
        args.append(new_experiment)
    if in_job and (new_project or new_experiment):
        conn.execute("UPDATE jobs SET project = COALESCE(?, project),"
                     " experiment = COALESCE(?, experiment) WHERE id = ?",
                     (new_project, new_experiment, row["job_id"]))
    if name and not row["name"]:
        sets.append("name = ?")
        args.append(name)
    if sets:
        conn.execute(f"UPDATE runs SET {', '.join(sets)} WHERE id = ?", (*args, run_id))


def node_of_attempt(conn, job_id, attempt):
    """The node a job attempt was assigned to (None: no such attempt)."""
    row = conn.execute("SELECT node FROM runs WHERE job_id = ? AND attempt = ?",
                       (job_id, attempt)).fetchone()
    return row["node"] if row else None


def node_of(conn, run_id):
    row = conn.execute("SELECT node FROM runs WHERE id = ?", (run_id,)).fetchone()
    return row["node"] if row else None


def job_on_node(conn, job_id, node):
    return conn.execute("SELECT 1 FROM runs WHERE job_id = ? AND node = ? LIMIT 1",
                        (job_id, node)).fetchone() is not None
