"""Events: lifecycle and rule findings, one table, newest last."""
from . import dumps, loads, now_ms


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
