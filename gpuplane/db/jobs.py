"""Jobs and their attempts: the state machine lives here, next to its SQL.

QUEUED → DISPATCHED → RUNNING → SUCCEEDED | FAILED | CANCELLED. Every attempt is a new run;
the attempt number is bumped in the same transaction that assigns the job to a node, so
no attempt is ever started twice.
"""
from . import dumps, events, loads, now_ms, runs, tokens

ACTIVE = ("DISPATCHED", "RUNNING")
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
FINAL_FAILURES = ("OOM", "EXIT_CODE", "DISPATCH_FAILED")   # never retried automatically


def to_dict(row):
    if row is None:
        return None
    d = dict(row)
    d["command"] = loads(d["command"])
    d["env"] = loads(d["env"], {})
    d["gpu_indices"] = loads(d["gpu_indices"])
    d["cpu_only"] = bool(d["cpu_only"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    return d


def submit(db, spec):
    ts = now_ms()
    with db.tx() as c:
        cur = c.execute(
            "INSERT INTO jobs (name, kind, command, working_dir, gpus, cpu_only, priority,"
            " max_attempts, env, project, experiment, tb_dir, watch_dir, parent_checkpoint_id,"
            " created_at, queued_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (spec["name"], spec.get("kind", "TRAIN"), dumps(spec["command"]),
             spec["working_dir"], spec["gpus"], int(spec["cpu_only"]), spec["priority"],
             spec["max_attempts"], dumps(spec["env"]), spec["project"], spec["experiment"],
             spec.get("tb_dir"), spec.get("watch_dir"), spec.get("parent_checkpoint_id"),
             ts, ts))
        job_id = cur.lastrowid
        events.add(c, "JOB_QUEUED", f"job {job_id} ({spec['name']}) queued", job_id=job_id)
    return get(db, job_id)


def get(db, job_id):
    return to_dict(db.query_one("SELECT * FROM jobs WHERE id = ?", (job_id,)))


def list_jobs(db, state=None, limit=100):
    if state:
        rows = db.query("SELECT * FROM jobs WHERE state = ? ORDER BY id DESC LIMIT ?",
                        (state, limit))
    else:
        rows = db.query("SELECT * FROM jobs ORDER BY id DESC LIMIT ?", (limit,))
    return [to_dict(r) for r in rows]


def queued(db):
    """Queued jobs in the order the scheduler considers them."""
    return [to_dict(r) for r in db.query(
        "SELECT * FROM jobs WHERE state = 'QUEUED' ORDER BY priority DESC, queued_at, id")]


def active(db, node=None):
    if node is None:
        rows = db.query("SELECT * FROM jobs WHERE state IN ('DISPATCHED', 'RUNNING')")
    else:
        rows = db.query("SELECT * FROM jobs WHERE state IN ('DISPATCHED', 'RUNNING')"
                        " AND node = ?", (node,))
    return [to_dict(r) for r in rows]


def set_pending_reason(db, job_id, reason):
    with db.tx() as c:
        c.execute("UPDATE jobs SET pending_reason = ? WHERE id = ? AND state = 'QUEUED'",
                  (reason, job_id))


def assign(db, job_id, node, gpu_indices, server_url):
    """Give a queued job to a node: new attempt, new run, ingest token. Returns the start
    command, or None when the job is no longer queued (cancelled meanwhile)."""
    with db.tx() as c:
        job = to_dict(c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
        if job is None or job["state"] != "QUEUED":
            return None
        attempt = job["attempt"] + 1
        run_id = runs.create(c, source="job", state="STARTING", project=job["project"],
                             experiment=job["experiment"], name=job["name"],
                             job_id=job_id, attempt=attempt, node=node,
                             gpu_indices=gpu_indices, config={"command": job["command"]})
        _, secret = tokens.create(db, f"run {run_id}", "ingest", run_id=run_id)
        c.execute(
            "UPDATE jobs SET state = 'DISPATCHED', attempt = ?, node = ?, gpu_indices = ?,"
            " run_id = ?, pending_reason = NULL, failure_kind = NULL, exit_code = NULL,"
            " message = NULL, started_at = NULL, ended_at = NULL WHERE id = ?",
            (attempt, node, dumps(gpu_indices), run_id, job_id))
        job.update(attempt=attempt, node=node, gpu_indices=gpu_indices, run_id=run_id)
        return start_command(job, secret, server_url)


def start_command(job, ingest_token, server_url):
    return {"type": "start", "job_id": job["id"], "attempt": job["attempt"],
            "run_id": job["run_id"], "command": job["command"],
            "working_dir": job["working_dir"], "env": job["env"],
            "gpus": job["gpu_indices"] or [], "cpu_only": job["cpu_only"],
            "tb_dir": job["tb_dir"], "watch_dir": job["watch_dir"],
            "server_url": server_url, "ingest_token": ingest_token}


def restart_command(db, job, server_url):
    """The same start command again (the agent never got it). A fresh ingest token for the
    same run: the first one's secret is not stored."""
    _, secret = tokens.create(db, f"run {job['run_id']}", "ingest", run_id=job["run_id"])
    return start_command(job, secret, server_url)


def mark_running(conn, job_id, attempt, ts):
    job = to_dict(conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
    run = conn.execute("SELECT id FROM runs WHERE job_id = ? AND attempt = ?",
                       (job_id, attempt)).fetchone()
    if run:
        runs.mark_running(conn, run["id"], ts)
    if job and job["attempt"] == attempt and job["state"] == "DISPATCHED":
        conn.execute("UPDATE jobs SET state = 'RUNNING', started_at = ? WHERE id = ?",
                     (ts, job_id))
        events.add(conn, "JOB_STARTED", f"job {job_id} attempt {attempt} started on "
                   f"{job['node']}", job_id=job_id, run_id=job["run_id"], node=job["node"])


def finish_attempt(conn, job_id, attempt, *, exit_code=None, failure_kind=None, message=None,
                   ts=None):
    """An attempt ended. Returns the job's new state, or None for a stale attempt."""
    ts = ts or now_ms()
    if failure_kind is None and exit_code not in (0, None):
        failure_kind = "EXIT_CODE"
    job = to_dict(conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
    run = conn.execute("SELECT id FROM runs WHERE job_id = ? AND attempt = ?",
                       (job_id, attempt)).fetchone()
    if failure_kind is None:
        run_state = "SUCCEEDED"
    elif failure_kind == "CANCELLED":
        run_state = "CANCELLED"
    else:
        run_state = "FAILED"
    if run:
        runs.finish(conn, run["id"], run_state, exit_code, failure_kind, ts)
    if job is None or job["attempt"] != attempt or job["state"] not in ACTIVE:
        return None
    if job["cancel_requested"] and failure_kind is not None:
        failure_kind, state = "CANCELLED", "CANCELLED"
    elif failure_kind is None:
        state = "SUCCEEDED"
    elif failure_kind == "CANCELLED" or failure_kind in FINAL_FAILURES:
        state = "CANCELLED" if failure_kind == "CANCELLED" else "FAILED"
    else:
        # Transient (the node or the shim was lost): a new attempt while any remain.
        failure_kind = "NODE_LOST" if failure_kind in ("LOST", "NODE_LOST") else failure_kind
        state = "QUEUED" if attempt < job["max_attempts"] else "FAILED"
    if state == "QUEUED":
        conn.execute(
            "UPDATE jobs SET state = 'QUEUED', node = NULL, gpu_indices = NULL,"
            " failure_kind = ?, exit_code = ?, message = ? WHERE id = ?",
            (failure_kind, exit_code, message, job_id))
        events.add(conn, "JOB_RETRIED", f"job {job_id} attempt {attempt} lost "
                   f"({failure_kind}); queued again as attempt {attempt + 1} of "
                   f"{job['max_attempts']}", severity="warning", job_id=job_id,
                   run_id=job["run_id"], node=job["node"])
    else:
        conn.execute(
            "UPDATE jobs SET state = ?, failure_kind = ?, exit_code = ?, message = ?,"
            " ended_at = ? WHERE id = ?",
            (state, failure_kind, exit_code, message, ts, job_id))
        kind = {"SUCCEEDED": "JOB_FINISHED", "FAILED": "JOB_FAILED",
                "CANCELLED": "JOB_CANCELLED"}[state]
        severity = {"JOB_FAILED": "warning" if failure_kind != "OOM" else "critical"}
        events.add(conn, kind if failure_kind != "OOM" else "OOM",
                   f"job {job_id} ({job['name']}) {state.lower()}"
                   + (f": {failure_kind}" if failure_kind else "")
                   + (f" (exit {exit_code})" if exit_code not in (None, 0) else ""),
                   severity=severity.get(kind, "info"), job_id=job_id,
                   run_id=job["run_id"], node=job["node"],
                   data={"exit_code": exit_code, "failure_kind": failure_kind})
    return state


def request_cancel(db, job_id):
    """Returns (job, (node, attempt) to send a cancel to, or None)."""
    with db.tx() as c:
        job = to_dict(c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
        if job is None or job["state"] in FINAL:
            return job, None
        if job["state"] == "QUEUED":
            c.execute("UPDATE jobs SET state = 'CANCELLED', failure_kind = 'CANCELLED',"
                      " ended_at = ?, pending_reason = NULL WHERE id = ?", (now_ms(), job_id))
            events.add(c, "JOB_CANCELLED", f"job {job_id} cancelled while queued",
                       job_id=job_id)
            return get(db, job_id), None
        c.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
    return get(db, job_id), (job["node"], job["attempt"])


def retry(db, job_id):
    """A failed or cancelled job goes back in the queue (its next attempt is a new run)."""
    with db.tx() as c:
        job = to_dict(c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
        if job is None or job["state"] not in ("FAILED", "CANCELLED"):
            return job, False
        c.execute("UPDATE jobs SET state = 'QUEUED', cancel_requested = 0, node = NULL,"
                  " gpu_indices = NULL, failure_kind = NULL, exit_code = NULL,"
                  " message = NULL, ended_at = NULL, queued_at = ?, max_attempts ="
                  " MAX(max_attempts, attempt + 1) WHERE id = ?", (now_ms(), job_id))
        events.add(c, "JOB_RETRIED", f"job {job_id} queued again by hand", job_id=job_id)
    return get(db, job_id), True
