"""Projects and experiments: the names runs and jobs are grouped under.

Runs and jobs carry the names (runs.project, runs.experiment); a row here exists for every
name in use (`ensure` is called where runs and jobs are made) and holds what the name
carries: a description and the archived flag. Renaming rewrites the name everywhere in one
transaction.
"""
from . import dumps, loads, now_ms


class Exists(Exception):
    pass


def ensure(conn, project, experiment=""):
    ts = now_ms()
    conn.execute("INSERT OR IGNORE INTO projects (name, created_at) VALUES (?, ?)",
                 (project, ts))
    if experiment:
        conn.execute("INSERT OR IGNORE INTO experiments (project, name, created_at)"
                     " VALUES (?, ?, ?)", (project, experiment, ts))


def _project(row):
    d = dict(row)
    d["archived"] = bool(d["archived"])
    if d.get("preemptible") is not None:
        d["preemptible"] = bool(d["preemptible"])
    return d


# A project's scheduling defaults (docs/scheduling.md): its jobs' time limit when they
# give none, the largest limit they may ask for, whether they are preemptible by default.
SCHEDULING_FIELDS = ("time_limit_s", "max_time_limit_s", "preemptible")


def scheduling_defaults(conn, project):
    """{time_limit_s, max_time_limit_s, preemptible} of a project (None: not set), inside
    the caller's transaction or read block."""
    row = conn.execute("SELECT time_limit_s, max_time_limit_s, preemptible FROM projects"
                       " WHERE name = ?", (project,)).fetchone()
    if row is None:
        return dict.fromkeys(SCHEDULING_FIELDS)
    return {"time_limit_s": row[0], "max_time_limit_s": row[1],
            "preemptible": None if row[2] is None else bool(row[2])}


def set_scheduling_defaults(db, name, fields):
    """Set (a value) or clear (None) the given SCHEDULING_FIELDS of a project, making it
    if it does not exist yet."""
    with db.tx() as c:
        ensure(c, name)
        for key, value in fields.items():
            assert key in SCHEDULING_FIELDS
            c.execute(f"UPDATE projects SET {key} = ? WHERE name = ?",
                      (None if value is None else int(value), name))
    return get_project(db, name)


_PROJECT_SQL = (
    "SELECT p.*, (SELECT count(*) FROM experiments e WHERE e.project = p.name) AS experiments,"
    " (SELECT count(*) FROM runs r WHERE r.project = p.name) AS runs FROM projects p")


def list_projects(db, archived=False):
    sql = _PROJECT_SQL + ("" if archived else " WHERE p.archived = 0") + " ORDER BY p.name"
    return [_project(r) for r in db.query(sql)]


def get_project(db, name):
    row = db.query_one(_PROJECT_SQL + " WHERE p.name = ?", (name,))
    return _project(row) if row else None


def create_project(db, name, description=""):
    with db.tx() as c:
        if c.execute("SELECT 1 FROM projects WHERE name = ?", (name,)).fetchone():
            raise Exists(name)
        c.execute("INSERT INTO projects (name, description, created_at) VALUES (?, ?, ?)",
                  (name, description, now_ms()))
    return get_project(db, name)


def update_project(db, name, *, new_name=None, description=None, archived=None):
    """Rename (everywhere the name is used), describe, archive or unarchive."""
    with db.tx() as c:
        if new_name and new_name != name:
            if c.execute("SELECT 1 FROM projects WHERE name = ?", (new_name,)).fetchone():
                raise Exists(new_name)
            for table, col in (("projects", "name"), ("experiments", "project"),
                               ("runs", "project"), ("jobs", "project"),
                               ("metric_definitions", "project")):
                c.execute(f"UPDATE {table} SET {col} = ? WHERE {col} = ?", (new_name, name))
            name = new_name
        if description is not None:
            c.execute("UPDATE projects SET description = ? WHERE name = ?", (description, name))
        if archived is not None:
            c.execute("UPDATE projects SET archived = ? WHERE name = ?", (int(archived), name))
            c.execute("UPDATE experiments SET archived = ? WHERE project = ?",
                      (int(archived), name))
    return get_project(db, name)


def usage(db, project, experiment=None):
    """(runs, jobs) that name this project (or experiment)."""
    if experiment is None:
        where, params = "project = ?", (project,)
    else:
        where, params = "project = ? AND experiment = ?", (project, experiment)
    runs = db.query_one(f"SELECT count(*) FROM runs WHERE {where}", params)[0]
    jobs = db.query_one(f"SELECT count(*) FROM jobs WHERE {where}", params)[0]
    return runs, jobs


def delete_project(db, name):
    with db.tx() as c:
        c.execute("DELETE FROM experiments WHERE project = ?", (name,))
        c.execute("DELETE FROM metric_definitions WHERE project = ?", (name,))
        c.execute("DELETE FROM projects WHERE name = ?", (name,))


# -- experiments ----------------------------------------------------------------------

_EXPERIMENT_SQL = (
    "SELECT e.*, (SELECT count(*) FROM runs r WHERE r.project = e.project"
    " AND r.experiment = e.name) AS runs FROM experiments e")


def _experiment(row):
    d = dict(row)
    d["archived"] = bool(d["archived"])
    d["retention"] = loads(d.get("retention"))
    return d


def set_experiment_retention(db, project, name, policy):
    """The experiment's checkpoint retention policy (None: none)."""
    with db.tx() as c:
        c.execute("UPDATE experiments SET retention = ? WHERE project = ? AND name = ?",
                  (dumps(policy) if policy else None, project, name))


def experiment_retention(db, project, name):
    row = db.query_one("SELECT retention FROM experiments WHERE project = ? AND name = ?",
                       (project, name))
    return loads(row[0]) if row else None


def list_experiments(db, project=None, archived=False):
    where, params = [], []
    if project is not None:
        where.append("e.project = ?")
        params.append(project)
    if not archived:
        where.append("e.archived = 0")
    sql = _EXPERIMENT_SQL + (" WHERE " + " AND ".join(where) if where else "")
    return [_experiment(r) for r in db.query(sql + " ORDER BY e.project, e.name", params)]


def get_experiment(db, project, name):
    row = db.query_one(_EXPERIMENT_SQL + " WHERE e.project = ? AND e.name = ?",
                       (project, name))
    return _experiment(row) if row else None


def projects_with_experiment(db, name):
    return [r[0] for r in db.query("SELECT project FROM experiments WHERE name = ?"
                                   " ORDER BY project", (name,))]


def create_experiment(db, project, name, description=""):
    with db.tx() as c:
        if c.execute("SELECT 1 FROM experiments WHERE project = ? AND name = ?",
                     (project, name)).fetchone():
            raise Exists(name)
        c.execute("INSERT INTO experiments (project, name, description, created_at)"
                  " VALUES (?, ?, ?, ?)", (project, name, description, now_ms()))
    return get_experiment(db, project, name)


def update_experiment(db, project, name, *, new_name=None, description=None, archived=None):
    with db.tx() as c:
        if new_name and new_name != name:
            if c.execute("SELECT 1 FROM experiments WHERE project = ? AND name = ?",
                         (project, new_name)).fetchone():
                raise Exists(new_name)
            c.execute("UPDATE experiments SET name = ? WHERE project = ? AND name = ?",
                      (new_name, project, name))
            for table in ("runs", "jobs", "metric_definitions"):
                c.execute(f"UPDATE {table} SET experiment = ? WHERE project = ?"
                          " AND experiment = ?", (new_name, project, name))
            name = new_name
        if description is not None:
            c.execute("UPDATE experiments SET description = ? WHERE project = ? AND name = ?",
                      (description, project, name))
        if archived is not None:
            c.execute("UPDATE experiments SET archived = ? WHERE project = ? AND name = ?",
                      (int(archived), project, name))
    return get_experiment(db, project, name)


def delete_experiment(db, project, name):
    with db.tx() as c:
        c.execute("DELETE FROM metric_definitions WHERE project = ? AND experiment = ?",
                  (project, name))
        c.execute("DELETE FROM experiments WHERE project = ? AND name = ?", (project, name))
