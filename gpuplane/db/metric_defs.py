"""Metric definitions: direction (min / max) and the primary flag of a key, per scope.

A scope is global (project '' and experiment ''), a project (experiment ''), or an
experiment. What a key means in an experiment is resolved experiment -> project ->
global, and without any definition its direction comes from its name, else it is unknown
(gpuplane/vocab.py decides; docs/metrics.md). One key at most is primary per scope.
"""
from . import now_ms, projects
from .. import vocab


def _scopes(project, experiment):
    """The scopes that apply, most specific first: (project, experiment, label)."""
    out = []
    if project and experiment:
        out.append((project, experiment, "experiment"))
    if project:
        out.append((project, "", "project"))
    out.append(("", "", "global"))
    return out


def to_dict(row):
    d = dict(row)
    d["primary"] = bool(d.pop("is_primary"))
    d["scope"] = ("experiment" if d["experiment"] else "project" if d["project"]
                  else "global")
    return d


def get(db, key, project="", experiment=""):
    row = db.query_one("SELECT * FROM metric_definitions WHERE project = ? AND experiment = ?"
                       " AND key = ?", (project, experiment, key))
    return to_dict(row) if row else None


def put(db, key, project="", experiment="", *, direction=None, primary=None,
        description=None):
    """Create or change a definition; fields left None keep their value. Setting a key
    primary clears the flag of the other keys of the same scope. A project or experiment
    that does not exist yet is created: a sweep's metric is set before its first run."""
    with db.tx() as c:
        if project:
            projects.ensure(c, project, experiment)
        c.execute("INSERT OR IGNORE INTO metric_definitions (key, project, experiment,"
                  " updated_at) VALUES (?, ?, ?, ?)", (key, project, experiment, now_ms()))
        if primary:
            c.execute("UPDATE metric_definitions SET is_primary = 0 WHERE project = ?"
                      " AND experiment = ? AND key != ?", (project, experiment, key))
        sets, params = ["updated_at = ?"], [now_ms()]
        for col, val in (("direction", direction), ("is_primary", primary),
                         ("description", description)):
            if val is not None:
                sets.append(f"{col} = ?")
                params.append(int(val) if isinstance(val, bool) else val)
        c.execute(f"UPDATE metric_definitions SET {', '.join(sets)} WHERE project = ?"
                  " AND experiment = ? AND key = ?", (*params, project, experiment, key))
    return get(db, key, project, experiment)


def delete(db, key, project="", experiment=""):
    with db.tx() as c:
        cur = c.execute("DELETE FROM metric_definitions WHERE project = ? AND experiment = ?"
                        " AND key = ?", (project, experiment, key))
        return cur.rowcount > 0


def list_definitions(db, project=None, experiment=None):
    """Definitions at the given scope and the scopes it inherits from (all when None)."""
    if project is None:
        rows = db.query("SELECT * FROM metric_definitions ORDER BY project, experiment, key")
    else:
        scopes = _scopes(project, experiment or "")
        marks = " OR ".join(["(project = ? AND experiment = ?)"] * len(scopes))
        rows = db.query(f"SELECT * FROM metric_definitions WHERE {marks}"
                        " ORDER BY project, experiment, key",
                        [v for p, e, _ in scopes for v in (p, e)])
    return [to_dict(r) for r in rows]


def defined_direction(db, key, project="", experiment=""):
    """(direction, scope label) of the most specific definition that gives one, else
    (None, None)."""
    for p, e, label in _scopes(project, experiment):
        row = db.query_one("SELECT direction FROM metric_definitions WHERE project = ?"
                           " AND experiment = ? AND key = ? AND direction IS NOT NULL",
                           (p, e, key))
        if row:
            return row[0], label
    return None, None


def defined_directions(db, project="", experiment=""):
    """{key: direction} of every definition that gives one in the scopes that apply to
    (project, experiment), the most specific winning: one query for a whole run."""
    scopes = _scopes(project, experiment)
    rank = {(p, e): i for i, (p, e, _) in enumerate(scopes)}
    marks = " OR ".join(["(project = ? AND experiment = ?)"] * len(scopes))
    out = {}
    rows = db.query(f"SELECT key, project, experiment, direction FROM metric_definitions"
                    f" WHERE direction IS NOT NULL AND ({marks})",
                    [v for p, e, _ in scopes for v in (p, e)])
    for r in sorted(rows, key=lambda r: -rank[(r["project"], r["experiment"])]):
        out[r["key"]] = r["direction"]
    return out


def resolve_direction(db, key, project="", experiment=""):
    """(direction, where it came from: experiment | project | global | name), or
    (None, None) when neither a definition nor the name says (vocab.direction)."""
    d, label = defined_direction(db, key, project, experiment)
    if d is not None:
        return d, label
    d = vocab.name_direction(key)
    return (d, "name") if d else (None, None)


def resolve_primary(db, project="", experiment=""):
    """The primary key of a scope: (key, where it is defined) or (None, None)."""
    for p, e, label in _scopes(project, experiment):
        row = db.query_one("SELECT key FROM metric_definitions WHERE project = ?"
                           " AND experiment = ? AND is_primary = 1", (p, e))
        if row:
            return row[0], label
    return None, None
