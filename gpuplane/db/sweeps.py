"""Sweeps and their trials: the rows and their SQL. What a sweep does (launching trials,
early stopping, stopping when its trials fail) is decided in gpuplane/sweeps.py; job state
changes go through gpuplane/lifecycle.py."""
from ..states import (CANCELLED, FAILED, JOB_ACTIVE, QUEUED, STOP_REASONS, SUCCEEDED,
                      SWEEP_ACTIVE, SWEEP_FINAL)
from . import dumps, loads, now_ms, projects

ACTIVE = SWEEP_ACTIVE               # a sweep that still launches trials
FINAL = SWEEP_FINAL


def _sweep(row):
    if row is None:
        return None
    d = dict(row)
    d["spec"] = loads(d["spec"], {})
    return d


def _trial(row):
    d = dict(row)
    d["params"] = loads(d["params"])            # None: a sampler's trial not asked yet
    d["stopped"] = loads(d.get("stopped"))
    d["told"] = loads(d.get("told"))
    d["retry"] = bool(d.get("retry"))
    return d


def create(conn, name, project, experiment, spec, trial_params):
    """A sweep and one trial row per parameter set, in launch order (None: asked of the
    sweep's sampler at launch). Returns its id."""
    ts = now_ms()
    projects.ensure(conn, project, experiment)
    sweep_id = conn.execute(
        "INSERT INTO sweeps (name, project, experiment, spec, created_at) VALUES (?,?,?,?,?)",
        (name, project, experiment, dumps(spec), ts)).lastrowid
    conn.executemany("INSERT INTO sweep_trials (sweep_id, number, params) VALUES (?,?,?)",
                     [(sweep_id, i, None if p is None else dumps(p))
                      for i, p in enumerate(trial_params)])
    return sweep_id


def get(db, sweep_id):
    return _sweep(db.query_one("SELECT * FROM sweeps WHERE id = ?", (sweep_id,)))


def fetch(conn, sweep_id):
    return _sweep(conn.execute("SELECT * FROM sweeps WHERE id = ?", (sweep_id,)).fetchone())


def list_sweeps(db, state=None, limit=100):
    """Sweeps, newest first, each with its trial counts by job state ('PENDING': not
    launched yet)."""
    where, args = ("WHERE s.state = ?", (state,)) if state else ("", ())
    rows = db.query(f"SELECT * FROM sweeps s {where} ORDER BY s.id DESC LIMIT ?",
                    (*args, limit))
    out = [_sweep(r) for r in rows]
    if out:
        ids = [s["id"] for s in out]
        counts = {}
        # a trial stopped by the platform counts by its stop (EARLY_STOPPED), not as a
        # cancel (gpuplane/states.py STOP_REASONS)
        stops = ",".join("?" * len(STOP_REASONS))
        state_of = (f"COALESCE(CASE WHEN j.failure_kind IN ({stops}) THEN j.failure_kind"
                    " ELSE j.state END, 'PENDING')")
        for sid, state_, n in db.query(
                f"SELECT t.sweep_id, {state_of}, count(*) FROM sweep_trials t"
                " LEFT JOIN jobs j ON j.id = t.job_id"
                f" WHERE t.sweep_id IN ({','.join('?' * len(ids))})"
                f" GROUP BY t.sweep_id, {state_of}",
                (*STOP_REASONS, *ids, *STOP_REASONS)):
            counts.setdefault(sid, {})[state_] = n
        for s in out:
            s["trial_states"] = counts.get(s["id"], {})
    return out


def active(db):
    return [_sweep(r) for r in db.query("SELECT * FROM sweeps WHERE state = 'RUNNING'"
                                        " ORDER BY id")]


_TRIALS = """
SELECT t.*, j.state AS job_state, j.run_id, j.attempt, j.failure_kind, j.exit_code,
       j.stop_reason AS job_stop_reason, j.started_at, j.ended_at, j.name AS job_name
FROM sweep_trials t LEFT JOIN jobs j ON j.id = t.job_id
"""


def trials(db, sweep_id):
    """A sweep's trials in order, each with its job's state, run and end."""
    out = []
    for r in db.query(_TRIALS + " WHERE t.sweep_id = ? ORDER BY t.number", (sweep_id,)):
        d = _trial(r)
        d["job_stop_reason"] = loads(d.get("job_stop_reason"))
        out.append(d)
    return out


def tally(db, sweep_id):
    """What a sweep's pass decides on, counted without reading every trial: `active`
    (its job queued or holding a slot), `failed` (not marked for a re-run), `succeeded`
    (or stopped early), `todo` (marked for a re-run, or never launched)."""
    row = db.query_one(
        "SELECT count(*) AS trials,"
        " coalesce(sum(j.state IN (?, ?, ?)), 0) AS active,"
        " coalesce(sum(j.state = ? AND t.retry = 0), 0) AS failed,"
        " coalesce(sum(j.state = ? OR (j.state = ?"
        "   AND t.stopped IS NOT NULL AND t.stopped != 'null')), 0) AS succeeded,"
        " coalesce(sum(t.retry != 0 OR t.job_id IS NULL), 0) AS todo"
        " FROM sweep_trials t LEFT JOIN jobs j ON j.id = t.job_id WHERE t.sweep_id = ?",
        (QUEUED, *JOB_ACTIVE, FAILED, SUCCEEDED, CANCELLED, sweep_id))
    return dict(row)


def next_trials(db, sweep_id, limit):
    """Up to `limit` trials to launch, in launch order: those marked for a re-run first,
    then those never launched."""
    return [_trial(r) for r in db.query(
        _TRIALS + " WHERE t.sweep_id = ? AND (t.retry != 0 OR t.job_id IS NULL)"
        " ORDER BY t.retry != 0 DESC, t.number LIMIT ?", (sweep_id, int(limit)))]


def untold(db, sweep_id):
    """A sampler's trials whose jobs ended and whose results the study was not told yet
    (a trial marked for a re-run waits for its new attempt)."""
    out = []
    for r in db.query(_TRIALS + " WHERE t.sweep_id = ? AND t.params IS NOT NULL"
                      " AND t.told IS NULL AND t.retry = 0 AND j.state IN (?, ?, ?)"
                      " ORDER BY t.number", (sweep_id, SUCCEEDED, FAILED, CANCELLED)):
        d = _trial(r)
        d["job_stop_reason"] = loads(d.get("job_stop_reason"))
        out.append(d)
    return out


def trial_of_job(conn, job_id):
    row = conn.execute("SELECT * FROM sweep_trials WHERE job_id = ?", (job_id,)).fetchone()
    return _trial(row) if row else None


def fetch_trial(conn, trial_id):
    row = conn.execute("SELECT * FROM sweep_trials WHERE id = ?", (trial_id,)).fetchone()
    return _trial(row) if row else None


def run_ids(db, sweep_id):
    """Every run of every trial (all attempts), for the recommendation across a sweep."""
    return [r[0] for r in db.query(
        "SELECT r.id FROM runs r JOIN sweep_trials t ON t.job_id = r.job_id"
        " WHERE t.sweep_id = ? ORDER BY r.id", (sweep_id,))]


# -- changes (inside the caller's transaction) --------------------------------------

def set_trial_job(conn, trial_id, job_id):
    conn.execute("UPDATE sweep_trials SET job_id = ?, retry = 0 WHERE id = ?",
                 (job_id, trial_id))


def set_trial_retry(conn, trial_id, retry=True):
    conn.execute("UPDATE sweep_trials SET retry = ?, stopped = NULL, told = NULL WHERE id = ?",
                 (int(retry), trial_id))


def set_trial_params(conn, trial_id, params):
    conn.execute("UPDATE sweep_trials SET params = ? WHERE id = ?", (dumps(params), trial_id))


def set_trial_told(conn, trial_id, told):
    conn.execute("UPDATE sweep_trials SET told = ? WHERE id = ?", (dumps(told), trial_id))


def set_trial_rung(conn, trial_id, rung):
    conn.execute("UPDATE sweep_trials SET rung = ? WHERE id = ?", (rung, trial_id))


def set_trial_stopped(conn, trial_id, decision):
    conn.execute("UPDATE sweep_trials SET stopped = ? WHERE id = ?",
                 (dumps(decision), trial_id))


def set_state(conn, sweep_id, state, stop_reason=None):
    conn.execute("UPDATE sweeps SET state = ?, stop_reason = ?, ended_at = ? WHERE id = ?",
                 (state, stop_reason, now_ms() if state in FINAL else None, sweep_id))
