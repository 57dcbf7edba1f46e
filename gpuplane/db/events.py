"""Events: lifecycle and rule findings, one table, newest last."""
from ..states import JOB_ACTIVE, QUEUED
from . import dumps, loads, not_system, now_ms


def add(conn, type, message="", *, severity="info", run_id=None, job_id=None, node=None,
        data=None, step=None, ts=None):
    """Append one event inside the caller's transaction; returns it as a dict."""
    event = {"run_id": run_id, "job_id": job_id, "node": node, "type": type,
             "severity": severity, "message": message, "data": data or {}, "step": step,
             "ts": ts or now_ms()}
    cur = conn.execute(
        "INSERT INTO events (run_id, job_id, node, type, severity, message, data, step, ts)"
        " VALUES (?,?,?,?,?,?,?,?,?)",
        (run_id, job_id, node, type, severity, message, dumps(event["data"]), step,
         event["ts"]))
    return {"id": cur.lastrowid, **event}


def list_events(db, run_id=None, job_id=None, after_id=0, limit=200, type=None):
    where, params = ["id > ?"], [after_id]
    if type is not None:
        where.append("type = ?")
        params.append(type)
    if run_id is not None:
        where.append("run_id = ?")
        params.append(run_id)
    if job_id is not None:
        where.append("job_id = ?")
        params.append(job_id)
    rows = db.query("SELECT * FROM events WHERE " + " AND ".join(where)
                    + " ORDER BY id DESC LIMIT ?", (*params, limit))
    out = []
    for r in reversed(rows):
        d = dict(r)
        d["data"] = loads(d["data"], {})
        out.append(d)
    return out


# -- the event engine (gpuplane/events.py) ------------------------------------------------

SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def _row(r):
    d = dict(r)
    d["data"] = loads(d["data"], {})
    return d


def record(conn, ev, window_ms, now=None):
    """Store a finding, debounced: when the same subject (run, else job, else node) already
    has an event of this type (and, for USER events, this name) within `window_ms`, its
    count grows instead. A finding whose fingerprint is stored already changes nothing.
    Returns (event id, True when a new row was added)."""
    now = now or now_ms()
    fp = ev.get("fingerprint")
    if fp and conn.execute("SELECT 1 FROM events WHERE fingerprint = ?", (fp,)).fetchone():
        return None, False
    where, params = ["type = ?", "ts >= ?"], [ev["type"], now - window_ms]
    for i, col in enumerate(("run_id", "job_id", "node")):
        if ev.get(col) is not None:
            # the subject: the run, else the job, else the node (not a run on that node)
            where.extend([f"{c} IS NULL" for c in ("run_id", "job_id")[:i]] + [f"{col} = ?"])
            params.append(ev[col])
            break
    else:
        where.append("run_id IS NULL AND job_id IS NULL AND node IS NULL")
    if ev["type"] == "USER":
        where.append("message = ?")
        params.append(ev.get("message", ""))
    row = conn.execute("SELECT id FROM events WHERE " + " AND ".join(where)
                       + " ORDER BY id DESC LIMIT 1", params).fetchone()
    if row is not None:
        conn.execute("UPDATE events SET count = count + ?, last_ts = ? WHERE id = ?",
                     (ev.get("count", 1), now, row[0]))
        return row[0], False
    cur = conn.execute(
        "INSERT INTO events (run_id, job_id, node, type, severity, message, data, step, ts,"
        " count, last_ts, fingerprint) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (ev.get("run_id"), ev.get("job_id"), ev.get("node"), ev["type"],
         ev.get("severity", "info"), ev.get("message", ""), dumps(ev.get("data") or {}),
         ev.get("step"), ev.get("ts") or now, ev.get("count", 1), now, fp))
    return cur.lastrowid, True


REFUSED_WINDOW_MS = 60_000


def points_refused(conn, run_id, refused, node=None):
    """The run's METRIC_POINTS_REFUSED event for a batch whose bad points were refused
    (and its good ones kept), debounced: within a minute the count grows."""
    return record(conn, {
        "type": "METRIC_POINTS_REFUSED", "severity": "warning", "run_id": run_id,
        "node": node, "count": refused.total,
        "message": f"run {run_id}: {refused.sentence()}; the other points of the batch were "
                   "stored (see docs/api.md, 'Metric ingest wire format')",
        "data": {"points": refused.total, "reasons": refused.as_list()}}, REFUSED_WINDOW_MS)


def add_count(conn, event_id, n, now=None):
    conn.execute("UPDATE events SET count = count + ?, last_ts = ? WHERE id = ?",
                 (n, now or now_ms(), event_id))


def query(db, *, run_id=None, job_id=None, types=None, min_severity=None, since_ms=None,
          after_id=0, limit=200, newest=False):
    """Events matching every given filter, oldest first: those after `after_id`, or with
    `newest` the latest `limit` of them."""
    where, params = ["id > ?"], [after_id]
    for col, v in (("run_id", run_id), ("job_id", job_id)):
        if v is not None:
            where.append(f"{col} = ?")
            params.append(v)
    if types:
        where.append("type IN (%s)" % ",".join("?" * len(types)))
        params.extend(types)
    if min_severity:
        ok = [s for s, r in SEVERITY_RANK.items() if r >= SEVERITY_RANK[min_severity]]
        where.append("severity IN (%s)" % ",".join("?" * len(ok)))
        params.extend(ok)
    if since_ms is not None:
        where.append("ts >= ?")
        params.append(since_ms)
    order = "DESC" if newest else "ASC"
    rows = db.query("SELECT * FROM events WHERE " + " AND ".join(where)
                    + f" ORDER BY id {order} LIMIT ?", (*params, limit))
    out = [_row(r) for r in rows]
    return out[::-1] if newest else out


def last_id(db):
    return db.query_one("SELECT coalesce(max(id), 0) FROM events")[0]


def run_context(db, run_id):
    """What the engine needs to know of a run: its job, node, state, source and scope."""
    row = db.query_one("SELECT id, job_id, attempt, node, state, source, project, experiment"
                       " FROM runs WHERE id = ?", (run_id,))
    return dict(row) if row else None


def run_of_attempt(db, job_id, attempt):
    row = db.query_one("SELECT id FROM runs WHERE job_id = ? AND attempt = ?",
                       (job_id, attempt))
    return row[0] if row else None


def recent_points(db, run_id, key, before_step, limit):
    """The latest `limit` points of a run's key below `before_step`, oldest first, to
    rebuild the engine's windows after a restart. NaN comes back as NaN."""
    rows = db.query(
        "SELECT p.step, p.value, p.ts FROM points p JOIN metric_keys k ON k.id = p.key_id"
        " WHERE k.run_id = ? AND k.key = ? AND p.step < ? ORDER BY p.step DESC LIMIT ?",
        (run_id, key, before_step, limit))
    return [(r[0], float("nan") if r[1] is None else r[1], r[2]) for r in reversed(rows)]


def running_job_runs(db):
    """Runs of jobs running now on a connected node (a disconnected node's jobs cannot
    report, so their silence says nothing): (run id, job id, node, started_at)."""
    return [tuple(r) for r in db.query(
        "SELECT r.id, r.job_id, r.node, r.started_at FROM runs r JOIN jobs j"
        " ON j.id = r.job_id AND j.run_id = r.id JOIN nodes n ON n.name = j.node"
        " WHERE j.state = 'RUNNING' AND n.state != 'disconnected'")]


def last_activity(db, run_id, job_id, attempt):
    """The times (ms) of a run's latest progress: points of keys that are not system keys, and
    its job's log lines — to rebuild STALLED's clock after a restart."""
    pts = []
    for (key_id,) in db.query("SELECT id FROM metric_keys WHERE run_id = ? AND "
                              f"{not_system('key')} LIMIT 50", (run_id,)):
        pts += [r[0] for r in db.query("SELECT ts FROM points WHERE key_id = ?"
                                       " ORDER BY step DESC LIMIT 65", (key_id,))]
    lines = [r[0] for r in db.query(
        "SELECT DISTINCT ts FROM logs WHERE job_id = ? AND attempt = ? ORDER BY id DESC"
        " LIMIT 65", (job_id, attempt))] if job_id is not None else []
    return sorted(set(pts) | set(lines))


def for_stop_on(db, ids):
    """Of these events, those on a job that may stop on events and has not ended or been
    cancelled (gpuplane/stop_on.py), oldest first, with the job's stop_on."""
    return db.query(
        "SELECT e.id, e.type, e.step, e.message, e.job_id, e.run_id, j.stop_on"
        " FROM events e JOIN jobs j ON j.id = e.job_id"
        f" WHERE e.id IN ({','.join('?' * len(ids))}) AND j.stop_on IS NOT NULL"
        " AND j.cancel_requested = 0 AND j.state IN (?, ?, ?) ORDER BY e.id",
        (*ids, QUEUED, *JOB_ACTIVE))
