"""Jobs: the rows and their SQL. Which state follows which is decided by
gpuplane/lifecycle.py, the only caller of the `set_*` functions here.

QUEUED → DISPATCHED → RUNNING → SUCCEEDED | FAILED | CANCELLED. Every attempt is a new run;
the attempt number is bumped in the same transaction that assigns the job to a node, so
no attempt is ever started twice.
"""
from ..states import JOB_ACTIVE, JOB_FINAL, QUEUED, STOP_REASONS, end_label
from . import dumps, loads, projects

ACTIVE = JOB_ACTIVE
FINAL = JOB_FINAL
# never retried automatically (TIMEOUT: a Slurm job past its time limit, docs/slurm.md)
FINAL_FAILURES = ("OOM", "EXIT_CODE", "DISPATCH_FAILED", "DEPENDENCY_FAILED", "TIMEOUT",
                  *STOP_REASONS)


def to_dict(row):
    if row is None:
        return None
    d = dict(row)
    d["command"] = loads(d["command"])
    d["env"] = loads(d["env"], {})
    d["eval_command"] = loads(d.get("eval_command"))
    d["gpu_indices"] = loads(d["gpu_indices"])
    d["cpu_only"] = bool(d["cpu_only"])
    d["cancel_requested"] = bool(d["cancel_requested"])
    d["depends_on"] = loads(d.get("depends_on"), [])
    d["depends_any"] = bool(d.get("depends_any"))
    d["held"] = bool(d.get("held"))
    d["config"] = loads(d.get("config"), {})
    d["stop_reason"] = loads(d.get("stop_reason"))
    d["resume"] = bool(d.get("resume"))
    d["retention"] = loads(d.get("retention"))
    d["preemptible"] = bool(d.get("preemptible"))
    d["project_given"] = bool(d.get("project_given", True))
    d["experiment_given"] = bool(d.get("experiment_given", True))
    d["stop_on"] = loads(d.get("stop_on"), [])
    if d.get("state") != QUEUED:
        d["expected_start"] = None          # an estimate for queued jobs only
    d["end"] = end_label(d)      # "early-stopped (ASHA rung 0, step 20)", ...
    return d


# -- reading ----------------------------------------------------------------------------

# A job as it is read: its row, and for an EVALUATE job `checkpoint_run_id`, the run that
# saved the checkpoint it scores (so a client never asks for the checkpoint to know it).
SELECT = ("SELECT jobs.*, (SELECT run_id FROM checkpoints WHERE checkpoints.id = "
          "jobs.parent_checkpoint_id) AS checkpoint_run_id FROM jobs")


def get(db, job_id):
    return to_dict(db.query_one(SELECT + " WHERE id = ?", (job_id,)))


def fetch(conn, job_id):
    """get() inside the caller's transaction."""
    return to_dict(conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())


def list_jobs(db, state=None, limit=100, ids=None):
    """Newest first; `ids`: only these jobs."""
    where, params = [], []
    if state:
        where.append("state = ?")
        params.append(state)
    if ids is not None:
        where.append(f"id IN ({','.join('?' * len(ids))})")
        params.extend(ids)
    sql = SELECT + (" WHERE " + " AND ".join(where) if where else "")
    rows = db.query(sql + " ORDER BY id DESC LIMIT ?", (*params, limit))
    return [to_dict(r) for r in rows]


def unfinished_in(db, working_dir, other_than, limit=50):
    """Jobs not yet ended that run in `working_dir` (newest first), but `other_than`."""
    return [to_dict(r) for r in db.query(
        SELECT + " WHERE working_dir = ? AND id != ? AND state IN (?, ?, ?)"
        " ORDER BY id DESC LIMIT ?",
        (working_dir, other_than, QUEUED, *JOB_ACTIVE, limit))]


def queued(db):
    """Queued jobs in the order the scheduler considers them."""
    return [to_dict(r) for r in db.query(
        "SELECT * FROM jobs WHERE state = 'QUEUED' ORDER BY priority DESC, queued_at, id")]


def placement_queue(db, room=None, after=None, limit=None):
    """The queue in placement order, as rows with only what placement reads (id, gpus,
    cpu_only, held, depends_on as stored JSON text, depends_any, pending_reason), nothing
    decoded: the scheduler reads the queue at every pass, and building a dict per job
    made a long queue's drain quadratic.

    room=(most free GPUs on one node, a free CPU slot anywhere): leave out the jobs whose
    reason the caller knows still holds: those that wait only for a slot, cannot fit now
    and have their reason, and held ones that have theirs (it changes only with a hold or
    a release, which clear it). after=(priority, queued_at, id) of the last row read,
    limit: one page."""
    sql = ("SELECT id, gpus, cpu_only, held, depends_on, depends_any, pending_reason, "
           "priority, queued_at, time_limit_s FROM jobs WHERE state = 'QUEUED'")
    args = ()
    if room is not None:
        sql += (" AND (held = 0 OR pending_reason IS NULL)"
                " AND (held != 0 OR depends_on IS NULL OR depends_on != '[]'"
                " OR pending_reason IS NULL OR (cpu_only != 0 AND ?)"
                " OR (cpu_only = 0 AND gpus <= ?))")
        args = (int(bool(room[1])), int(room[0]))
    order = " ORDER BY priority DESC, queued_at, id LIMIT ?"
    if after is None:
        return db.query(sql + order, args + (-1 if limit is None else int(limit),))
    # What follows `after`, as two seeks along jobs_queue: the rest of its priority, then
    # the lower ones. One condition with OR walked the index from the queue's head at
    # every page, which made a pass over a queue that holds many jobs it reads
    # (held, waiting for others) quadratic. (LIMIT -1: no limit.)
    p, q, i = after
    rows = db.query(sql + " AND priority = ? AND (queued_at, id) > (?, ?)"
                    " ORDER BY queued_at, id LIMIT ?",
                    args + (p, q, i, -1 if limit is None else int(limit)))
    if limit is None or len(rows) < limit:
        rows += db.query(sql + " AND priority < ?" + order,
                         args + (p, -1 if limit is None else int(limit) - len(rows)))
    return rows


def retention_keys(db, ids):
    """[(id, retention as stored JSON text, project, experiment)] of the jobs `ids` that are
    not EVALUATE jobs: what deciding whether a job has a retention policy reads."""
    out = []
    for at in range(0, len(ids), 500):
        chunk = list(ids[at:at + 500])
        out += [tuple(r) for r in db.query(
            "SELECT id, retention, project, experiment FROM jobs WHERE id IN "
            f"({','.join('?' * len(chunk))}) AND kind IS NOT 'EVALUATE'", chunk)]
    return out


def gpu_queue(db, limit, offset=0):
    """Queued GPU jobs that wait only for slots (not held, no dependency), in placement
    order, `limit` from `offset`: backfill's head and the expected starts
    (gpuplane/backfill.py) read them."""
    return db.query(
        "SELECT id, gpus, priority, queued_at, time_limit_s FROM jobs WHERE state = 'QUEUED'"
        " AND cpu_only = 0 AND held = 0 AND (depends_on IS NULL OR depends_on = '[]')"
        " ORDER BY priority DESC, queued_at, id LIMIT ? OFFSET ?", (int(limit), int(offset)))


def running_ends(db, now):
    """[(id, node, gpu indices, end ms or None)] of the GPU jobs holding slots: when each
    will have ended by its time limit (from its start, or now for one not started yet;
    None: it has no limit)."""
    out = []
    for r in db.query("SELECT id, node, gpu_indices, started_at, time_limit_s FROM jobs"
                      " WHERE state IN ('DISPATCHED', 'RUNNING') AND cpu_only = 0"):
        start = r["started_at"] or now
        out.append((r["id"], r["node"], loads(r["gpu_indices"]) or [],
                    start + r["time_limit_s"] * 1000 if r["time_limit_s"] else None))
    return out


def preemptible_running(db):
    """[(id, node, gpu indices, priority, started_at)] of the running preemptible GPU jobs
    no stop has been asked of: what priority preemption may stop (gpuplane/scheduler.py)."""
    return [(r["id"], r["node"], loads(r["gpu_indices"]) or [], r["priority"], r["started_at"])
            for r in db.query(
                "SELECT id, node, gpu_indices, priority, started_at FROM jobs"
                " WHERE state = 'RUNNING' AND preemptible != 0 AND cancel_requested = 0"
                " AND cpu_only = 0")]


def being_preempted_for(db, job_id):
    """[(id, node)] of the jobs still stopping because they were preempted for this one."""
    return [(r[0], r[1]) for r in db.query(
        "SELECT id, node FROM jobs WHERE preempted_by = ? AND cancel_requested != 0"
        " AND state IN ('DISPATCHED', 'RUNNING') ORDER BY id", (job_id,))]


def pending_reason(db, job_id):
    row = db.query_one("SELECT pending_reason FROM jobs WHERE id = ?", (job_id,))
    return row[0] if row else None


def set_preempted(conn, job_id, by, stop_reason):
    conn.execute("UPDATE jobs SET cancel_requested = 1, stop_reason = ?, preempted_by = ?"
                 " WHERE id = ?", (dumps(stop_reason), by, job_id))


def set_requeued_after_preemption(conn, job_id):
    """Back in the queue at its place (its queued_at kept) for an attempt that resumes
    from its last checkpoint; the attempt a preemption took does not count against it."""
    conn.execute(
        "UPDATE jobs SET state = 'QUEUED', node = NULL, gpu_indices = NULL, resume = 1,"
        " cancel_requested = 0, stop_reason = NULL, failure_kind = NULL, exit_code = NULL,"
        " message = NULL, max_attempts = MAX(max_attempts, attempt + 1) WHERE id = ?",
        (job_id,))


def set_expected_starts(db, starts):
    """{job id: expected start ms or None (unknown)} of queued jobs: an estimate, shown
    with the job (docs/scheduling.md); not a state change."""
    with db.tx() as c:
        c.executemany("UPDATE jobs SET expected_start = ? WHERE id = ? AND state = 'QUEUED'",
                      [(None if v is None else int(v), k) for k, v in starts.items()])


def slots_in_use(db):
    """[(node, gpu indices, cpu_only)] of the jobs holding slots (DISPATCHED, RUNNING):
    what the scheduler subtracts at every pass, without decoding each job."""
    return [(r["node"], loads(r["gpu_indices"]) or [], bool(r["cpu_only"])) for r in db.query(
        "SELECT node, gpu_indices, cpu_only FROM jobs WHERE state IN ('DISPATCHED', 'RUNNING')")]


def active(db, node=None):
    if node is None:
        rows = db.query("SELECT * FROM jobs WHERE state IN ('DISPATCHED', 'RUNNING')")
    else:
        rows = db.query("SELECT * FROM jobs WHERE state IN ('DISPATCHED', 'RUNNING')"
                        " AND node = ?", (node,))
    return [to_dict(r) for r in rows]


def set_pending_reasons(db, reasons):
    """Why queued jobs wait ({job id: reason}): a note for people, not a state change."""
    with db.tx() as c:
        c.executemany("UPDATE jobs SET pending_reason = ? WHERE id = ? AND state = 'QUEUED'",
                      [(reason, job_id) for job_id, reason in reasons.items()])


def set_pending_reason(conn, job_id, reason):
    """set_pending_reasons() for one job, inside the caller's transaction."""
    conn.execute("UPDATE jobs SET pending_reason = ? WHERE id = ? AND state = 'QUEUED'",
                 (reason, job_id))


# -- state changes (inside the caller's transaction; called by gpuplane/lifecycle.py) --

def insert(conn, spec, ts):
    cur = conn.execute(
        "INSERT INTO jobs (name, kind, command, working_dir, gpus, cpu_only, priority,"
        " max_attempts, env, project, experiment, tb_dir, watch_dir, parent_checkpoint_id,"
        " depends_on, depends_any, held, eval_command, image, config, sweep_id,"
        " created_at, queued_at, cpus, mem_mb, time_limit_min, retention, time_limit_s,"
        " time_signal, preemptible, project_given, experiment_given, stop_on)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (spec["name"], spec.get("kind", "TRAIN"), dumps(spec["command"]),
         spec["working_dir"], spec["gpus"], int(spec["cpu_only"]), spec["priority"],
         spec["max_attempts"], dumps(spec["env"]), spec["project"], spec["experiment"],
         spec.get("tb_dir"), spec.get("watch_dir"), spec.get("parent_checkpoint_id"),
         dumps(spec.get("depends_on") or []), int(bool(spec.get("depends_any"))),
         int(bool(spec.get("held"))),
         dumps(spec["eval_command"]) if spec.get("eval_command") else None,
         spec.get("image"), dumps(spec["config"]) if spec.get("config") else None,
         spec.get("sweep_id"), ts, ts, spec.get("cpus"), spec.get("mem_mb"),
         -(-spec["time_limit_s"] // 60) if spec.get("time_limit_s") else None,
         dumps(spec["retention"]) if spec.get("retention") else None,
         spec.get("time_limit_s"), spec.get("time_signal"), int(bool(spec.get("preemptible"))),
         int(spec.get("project_given", True)), int(spec.get("experiment_given", True)),
         dumps(spec["stop_on"]) if spec.get("stop_on") else None))
    projects.ensure(conn, spec["project"], spec["experiment"])
    return cur.lastrowid


def set_dispatched(conn, job_id, attempt, node, gpu_indices, run_id):
    conn.execute(
        "UPDATE jobs SET state = 'DISPATCHED', attempt = ?, node = ?, gpu_indices = ?,"
        " run_id = ?, pending_reason = NULL, failure_kind = NULL, exit_code = NULL,"
        " message = NULL, started_at = NULL, ended_at = NULL WHERE id = ?",
        (attempt, node, dumps(gpu_indices), run_id, job_id))


def set_running(conn, job_id, ts):
    conn.execute("UPDATE jobs SET state = 'RUNNING', started_at = ?, pending_reason = NULL"
                 " WHERE id = ?", (ts, job_id))


def set_waiting_in_slurm(conn, job_id, attempt, reason):
    """A dispatched attempt that Slurm holds PENDING: why, for people (docs/slurm.md)."""
    conn.execute("UPDATE jobs SET pending_reason = ? WHERE id = ? AND attempt = ?"
                 " AND state = 'DISPATCHED'", (reason, job_id, attempt))


def set_requeued(conn, job_id, failure_kind, exit_code, message):
    """An attempt was lost: back in the queue for the next one."""
    conn.execute(
        "UPDATE jobs SET state = 'QUEUED', node = NULL, gpu_indices = NULL, resume = 1,"
        " failure_kind = ?, exit_code = ?, message = ? WHERE id = ?",
        (failure_kind, exit_code, message, job_id))


def set_ended(conn, job_id, state, failure_kind, exit_code, message, ts):
    conn.execute(
        "UPDATE jobs SET state = ?, failure_kind = ?, exit_code = ?, message = ?,"
        " ended_at = ?, pending_reason = NULL WHERE id = ?",
        (state, failure_kind, exit_code, message, ts, job_id))


def set_cancel_requested(conn, job_id, stop_reason=None):
    conn.execute("UPDATE jobs SET cancel_requested = 1, stop_reason = ? WHERE id = ?",
                 (dumps(stop_reason) if stop_reason else None, job_id))


def set_stop_reason(conn, job_id, stop_reason):
    conn.execute("UPDATE jobs SET stop_reason = ? WHERE id = ?",
                 (dumps(stop_reason) if stop_reason else None, job_id))


def states(db, job_ids):
    """{job id: (state, name)} of the given jobs that exist. 500 ids a query: the
    scheduler asks for all that a page of the queue (or the whole queue) runs after."""
    ids = sorted({int(i) for i in job_ids})
    out = {}
    for at in range(0, len(ids), 500):
        chunk = ids[at:at + 500]
        out.update((r["id"], (r["state"], r["name"])) for r in db.query(
            f"SELECT id, state, name FROM jobs WHERE id IN ({','.join('?' * len(chunk))})",
            chunk))
    return out


def dependency_map(conn):
    """{job id: [ids it depends on]} for every job with dependencies."""
    return {r["id"]: loads(r["depends_on"], []) for r in conn.execute(
        "SELECT id, depends_on FROM jobs WHERE depends_on != '[]'")}


def set_held(conn, job_id, held):
    conn.execute("UPDATE jobs SET held = ?, pending_reason = NULL WHERE id = ?"
                 " AND state = 'QUEUED'", (int(held), job_id))


def set_queued_fields(conn, job_id, priority=None, depends_on=None, depends_any=None):
    """Edit a queued job's place in the queue or what it waits for."""
    if priority is not None:
        conn.execute("UPDATE jobs SET priority = ? WHERE id = ?", (priority, job_id))
    if depends_on is not None:
        conn.execute("UPDATE jobs SET depends_on = ?, pending_reason = NULL WHERE id = ?",
                     (dumps(depends_on), job_id))
    if depends_any is not None:
        conn.execute("UPDATE jobs SET depends_any = ? WHERE id = ?", (int(depends_any), job_id))


def set_queued_by_hand(conn, job_id, ts, resume=False):
    conn.execute("UPDATE jobs SET state = 'QUEUED', cancel_requested = 0, node = NULL,"
                 " stop_reason = NULL, resume = ?,"
                 " gpu_indices = NULL, failure_kind = NULL, exit_code = NULL,"
                 " message = NULL, ended_at = NULL, queued_at = ?, max_attempts ="
                 " MAX(max_attempts, attempt + 1) WHERE id = ?", (int(resume), ts, job_id))
