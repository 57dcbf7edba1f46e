"""Checkpoints and their evaluations.

`register` is the one insert path, for the SDK (REST), the agent's watcher (outbox
records) and imports: one row per (run, absolute path), so the same file seen twice is
one checkpoint whose fingerprint and size are brought up to date. A checkpoint's metric
values are the run's points at the nearest step, read when asked for (they may arrive
after the checkpoint). An evaluation is an EVALUATE job: its state is the job's, its
results what the job's run logged.
"""
import os
import re

from .. import states
from . import LimitExceeded, dumps, loads, not_system, now_ms

# How sure a step is; a registration only replaces a step with a surer one.
STEP_RANK = {"none": 0, "latest": 1, "name": 2, "given": 3}

# An evaluation's state, from its job's: queued until it runs; a cancel is a failure.
EVAL_STATE = {states.QUEUED: states.QUEUED, states.DISPATCHED: states.QUEUED,
              states.RUNNING: states.RUNNING, states.SUCCEEDED: states.SUCCEEDED,
              states.FAILED: states.FAILED, states.CANCELLED: states.FAILED}

# Keys the agent measures itself (gpuplane/vocab.py's system keys) are not training
# semantics: left out of checkpoint values.


def guess_format(path):
    name = os.path.basename(path.rstrip("/"))
    low = name.lower()
    if low.endswith((".pt", ".pth", ".bin")):
        return "pt"
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith(".ckpt"):
        return "lightning"
    if low.endswith((".keras", ".h5")):
        return "keras"
    if re.fullmatch(r"checkpoint-\d+", name):
        return "hf"
    return None


def latest_step(conn, run_id):
    """The run's latest step over its training keys (None without points)."""
    row = conn.execute(
        "SELECT max((SELECT max(step) FROM points WHERE key_id = k.id)) FROM metric_keys k"
        " WHERE k.run_id = ? AND " + not_system("k.key"), (run_id,)).fetchone()
    return row[0]


MAX_PER_RUN = 10_000


def register(conn, run_id, path, *, step=None, step_source=None, epoch=None,
             size_bytes=None, fingerprint=None, fmt=None, source="sdk", ts=None,
             mtime_ns=None, content=None):
    """Insert or update the checkpoint (run_id, path) inside the caller's transaction.

    `path` must be absolute. `step_source` is 'given' (the SDK said so) or 'name' (parsed
    from the file name); a None step becomes the run's latest step. `mtime_ns` and
    `content` (the agent's fingerprint of the bytes) say which version of the file this
    is: another run's live record of the same file on the same node that held other bytes
    is marked replaced by this one (see replace_others). Returns (id, created).
    """
    ts = ts or now_ms()
    if step is None:
        step = latest_step(conn, run_id)
        step_source = "latest" if step is not None else "none"
    else:
        step_source = step_source or "given"
    fmt = fmt or guess_format(path)
    old = conn.execute("SELECT id, step_source FROM checkpoints WHERE run_id = ? AND path = ?",
                       (run_id, path)).fetchone()
    if old is None:
        n = conn.execute("SELECT count(*) FROM checkpoints WHERE run_id = ?",
                         (run_id,)).fetchone()[0]
        if n >= MAX_PER_RUN:
            raise LimitExceeded(f"run {run_id} has {n} checkpoints; a run keeps at most "
                                f"{MAX_PER_RUN} (register fewer, or prune old ones)")
        cur = conn.execute(
            "INSERT INTO checkpoints (run_id, path, step, step_source, epoch, size_bytes,"
            " fingerprint, format, source, created_at, updated_at, mtime_ns, content)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, path, step, step_source, epoch, size_bytes, fingerprint, fmt, source,
             ts, ts, mtime_ns, content))
        replace_others(conn, cur.lastrowid, run_id, path, content, mtime_ns, ts)
        return cur.lastrowid, True
    # the same or a surer source replaces the step (a rewritten last.ckpt moves on); a
    # step parsed from the name never replaces one the SDK gave
    if STEP_RANK[step_source] >= STEP_RANK.get(old["step_source"], 0):
        conn.execute("UPDATE checkpoints SET step = ?, step_source = ? WHERE id = ?",
                     (step, step_source, old["id"]))
    # the run's own rewrite (last.ckpt each epoch) moves its record on: the bytes are its
    # run's newest, and the record is live again if another run's write had replaced it
    conn.execute(
        "UPDATE checkpoints SET epoch = COALESCE(?, epoch), size_bytes = COALESCE(?, size_bytes),"
        " fingerprint = COALESCE(?, fingerprint), format = COALESCE(format, ?),"
        " mtime_ns = COALESCE(?, mtime_ns), content = COALESCE(?, content),"
        " replaced_at = CASE WHEN ? IS NULL THEN replaced_at END,"
        " replaced_by = CASE WHEN ? IS NULL THEN replaced_by END,"
        " replaced_why = CASE WHEN ? IS NULL THEN replaced_why END,"
        " updated_at = ? WHERE id = ?",
        (epoch, size_bytes, fingerprint, fmt, mtime_ns, content, content, content, content,
         ts, old["id"]))
    replace_others(conn, old["id"], run_id, path, content, mtime_ns, ts)
    return old["id"], False


def replace_others(conn, ckpt_id, run_id, path, content, mtime_ns, ts):
    """Other runs' live records of the same file on the same node whose bytes differ
    from the version just registered are marked replaced by `ckpt_id` (kept, never
    re-pointed): evaluating them would evaluate someone else's weights. Without a
    content fingerprint (an SDK registration) nothing is known to differ."""
    if content is None and mtime_ns is None:
        return 0
    cur = conn.execute(
        "UPDATE checkpoints SET replaced_at = ?, replaced_by = ?, replaced_why = ?"
        " WHERE path = ? AND run_id != ? AND replaced_at IS NULL AND deleted_at IS NULL"
        " AND (CASE WHEN ? IS NOT NULL THEN content IS NOT ?"
        "           ELSE mtime_ns IS NOT ? END)"
        " AND run_id IN (SELECT id FROM runs WHERE node IS"
        "                (SELECT node FROM runs WHERE id = ?))",
        (ts, ckpt_id, f"the file was rewritten by run {run_id} (checkpoint {ckpt_id})",
         path, run_id, content, content, mtime_ns, run_id))
    return cur.rowcount


def mark_replaced(conn, checkpoint_id, why, ts=None):
    """The agent found the file's bytes changed since they were registered (an evaluation
    or a deletion refused): the record is replaced, with the agent's sentence."""
    conn.execute("UPDATE checkpoints SET replaced_at = ?, replaced_why = ? WHERE id = ?"
                 " AND replaced_at IS NULL", (ts or now_ms(), why[:500], checkpoint_id))


def replaced_sentence(ckpt):
    """Why a replaced checkpoint is refused (evaluate, recommend, retention), or None."""
    if not ckpt.get("replaced_at"):
        return None
    why = ckpt.get("replaced_why") or "the file was rewritten after it was registered"
    return (f"checkpoint {ckpt['id']} was replaced: {why}, so its file no longer holds "
            f"the weights of run {ckpt['run_id']}; pick a live checkpoint "
            f"(`gpuplane ckpt list --run {ckpt['run_id']}`)")


def _row(r):
    d = dict(r)
    if "pinned" in d:
        d["pinned"] = bool(d["pinned"])
    return d


RESUME_CANDIDATES = 5


def resume_candidates(conn, job_id, attempt):
    """The checkpoints a new attempt of the job may resume from: those of its earlier
    attempts' runs that retention has not deleted, the highest step first (then the newest):
    [{"checkpoint_id", "path", "step"}]. The agent takes the first that exists on its host."""
    rows = conn.execute(
        "SELECT c.id, c.path, c.step FROM checkpoints c JOIN runs r ON r.id = c.run_id"
        " WHERE r.job_id = ? AND r.attempt < ? AND c.deleted_at IS NULL"
        " AND c.replaced_at IS NULL"
        " ORDER BY c.step IS NULL, c.step DESC, c.updated_at DESC, c.id DESC LIMIT ?",
        (job_id, attempt, RESUME_CANDIDATES)).fetchall()
    return [{"checkpoint_id": r[0], "path": r[1], "step": r[2]} for r in rows]


def of_job_runs(db, job_id):
    """Every checkpoint of the job's runs with its run's node, attempt and whether it has
    an evaluation, by run then step."""
    return [dict(r) for r in db.query(
        "SELECT c.*, r.node, r.attempt, EXISTS (SELECT 1 FROM evaluations e"
        " WHERE e.checkpoint_id = c.id) AS evaluated,"
        # another job's run holds a live record of the same file on the same node:
        # retention never deletes it for this job (retention.plan)
        " (SELECT o.run_id FROM checkpoints o JOIN runs orun ON orun.id = o.run_id"
        "  WHERE o.path = c.path AND o.run_id != c.run_id AND orun.node IS r.node"
        "  AND orun.job_id IS NOT r.job_id AND o.replaced_at IS NULL"
        "  AND o.deleted_at IS NULL LIMIT 1) AS held_elsewhere"
        " FROM checkpoints c"
        " JOIN runs r ON r.id = c.run_id WHERE r.job_id = ? ORDER BY c.run_id, c.step, c.id",
        (job_id,))]


def set_keep_reasons(conn, reasons):
    """{checkpoint id: why retention keeps it, or None}."""
    conn.executemany("UPDATE checkpoints SET keep_reason = ? WHERE id = ?",
                     [(why, cid) for cid, why in reasons.items()])


def mark_deleted(conn, checkpoint_id, run_id, bytes_freed, ts):
    """The owning agent deleted it: marked, never removed from the registry."""
    conn.execute("UPDATE checkpoints SET deleted_at = ?, bytes_freed = ?, keep_reason = NULL"
                 " WHERE id = ? AND run_id = ?", (ts, bytes_freed, checkpoint_id, run_id))


def set_pinned(db, checkpoint_id, pinned):
    with db.tx() as c:
        c.execute("UPDATE checkpoints SET pinned = ? WHERE id = ?", (int(pinned), checkpoint_id))


def of_job(conn, checkpoint_id, job_id):
    """Whether the checkpoint belongs to a run of the job."""
    return conn.execute("SELECT 1 FROM checkpoints c JOIN runs r ON r.id = c.run_id"
                        " WHERE c.id = ? AND r.job_id = ?", (checkpoint_id, job_id)
                        ).fetchone() is not None


_SELECT = ("SELECT c.*, r.project, r.experiment, r.job_id FROM checkpoints c"
           " JOIN runs r ON r.id = c.run_id")


def get(db, checkpoint_id):
    row = db.query_one(_SELECT + " WHERE c.id = ?", (checkpoint_id,))
    return _row(row) if row else None


def list_checkpoints(db, run_id=None, project=None, experiment=None, limit=1000):
    where, params = [], []
    for col, val in (("c.run_id", run_id), ("r.project", project),
                     ("r.experiment", experiment)):
        if val is not None:
            where.append(f"{col} = ?")
            params.append(val)
    sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY c.run_id, c.step IS NULL, c.step, c.id LIMIT ?"
    return [_row(r) for r in db.query(sql, (*params, limit))]


_NEAREST = """
WITH k AS MATERIALIZED (
    SELECT k.id, k.key,
           (SELECT step FROM points WHERE key_id = k.id AND step <= :s
            ORDER BY step DESC LIMIT 1) AS lo,
           (SELECT step FROM points WHERE key_id = k.id AND step >= :s
            ORDER BY step LIMIT 1) AS hi
    FROM metric_keys k WHERE k.run_id = :r AND """ + not_system("k.key") + """
), n AS MATERIALIZED (
    SELECT id, key, CASE WHEN lo IS NULL THEN hi WHEN hi IS NULL THEN lo
                         WHEN :s - lo <= hi - :s THEN lo ELSE hi END AS step FROM k
)
SELECT n.key, n.step, (SELECT value FROM points WHERE key_id = n.id AND step = n.step),
       coalesce((SELECT pruned_step FROM metric_rollup WHERE key_id = n.id), -1)
FROM n WHERE n.step IS NOT NULL ORDER BY n.key
"""


def metrics_at(db, run_id, step):
    """{key: {"step", "value"}}: the run's points nearest to `step` (the earlier on a tie).
    A value of None is NaN."""
    if step is None:
        return {}
    return {key: {"step": s, "value": v}
            for key, s, v, pruned in db.query(_NEAREST, {"r": run_id, "s": step})
            if not from_pruned(step, s, pruned)}


def from_pruned(step, at, pruned):
    """Whether the point at `at`, nearest to a checkpoint's `step`, stands in for points
    retention deleted: inside the pruned range only the checkpoint's own step counts
    (retention keeps it, gpuplane/db/metrics.py prune_key); a neighbour there may be any
    distance away from what was logged next to the checkpoint, so there is no value."""
    return at is not None and at != step and pruned is not None and pruned >= 0 and (
        at <= pruned or step <= pruned)


# -- evaluations ------------------------------------------------------------------------

def add_evaluation(conn, checkpoint_id, job_id, command):
    cur = conn.execute("INSERT INTO evaluations (checkpoint_id, job_id, command, created_at)"
                       " VALUES (?, ?, ?, ?)", (checkpoint_id, job_id, dumps(command),
                                                now_ms()))
    return cur.lastrowid


_EVAL_SELECT = ("SELECT e.id, e.checkpoint_id, e.job_id, e.command, e.created_at,"
                " j.state AS job_state, j.run_id, j.failure_kind, j.message, j.ended_at"
                " FROM evaluations e JOIN jobs j ON j.id = e.job_id")


def _evaluation(db, row):
    d = dict(row)
    d["command"] = loads(d["command"])
    d["state"] = EVAL_STATE.get(d["job_state"], d["job_state"])
    d["results"] = _latest_values(db, d["run_id"]) if d["run_id"] else {}
    return d


def _latest_values(db, run_id):
    return {key: {"step": s, "value": v} for key, s, v in db.query(
        "SELECT k.key, p.step, p.value FROM metric_keys k JOIN points p ON p.key_id = k.id"
        " AND p.step = (SELECT max(step) FROM points WHERE key_id = k.id)"
        f" WHERE k.run_id = ? AND {not_system('k.key')} ORDER BY k.key", (run_id,))}


def evaluations(db, checkpoint_id):
    return [_evaluation(db, r) for r in db.query(
        _EVAL_SELECT + " WHERE e.checkpoint_id = ? ORDER BY e.id", (checkpoint_id,))]


def get_evaluation(db, evaluation_id):
    row = db.query_one(_EVAL_SELECT + " WHERE e.id = ?", (evaluation_id,))
    return _evaluation(db, row) if row else None


def evaluated_keys(db, project, experiment):
    """(key, count) of the metrics the evaluations of a scope's checkpoints logged."""
    where, params = ["r.project = ?"], [project]
    if experiment:
        where.append("r.experiment = ?")
        params.append(experiment)
    return db.query(
        "SELECT k.key, count(*) FROM runs r JOIN metric_keys k ON k.run_id = r.id"
        f" WHERE r.kind = 'EVALUATE' AND {' AND '.join(where)} AND {not_system('k.key')}"
        " GROUP BY k.key ORDER BY k.key", params)


# -- recommend --------------------------------------------------------------------------

def _scope_sql(run_id, project, experiment, alias="c", sweep_id=None):
    """WHERE over runs r (and their jobs j) for a scope; `alias` names what holds the run
    id (c: checkpoints, r: runs). sweep_id: the runs of that sweep's trials."""
    where, params = ["COALESCE(j.kind, 'TRAIN') != 'EVALUATE'"], []
    for col, val in ((f"{alias}.run_id" if alias == "c" else "r.id", run_id),
                     ("r.project", project), ("r.experiment", experiment),
                     ("j.sweep_id", sweep_id)):
        if val is not None:
            where.append(f"{col} = ?")
            params.append(val)
    return " AND ".join(where), params


def scope_keys(db, run_id=None, project=None, experiment=None, sweep_id=None):
    """Metric keys of the runs holding checkpoints in the scope, with how many runs log each."""
    where, params = _scope_sql(run_id, project, experiment, sweep_id=sweep_id)
    return db.query(
        "SELECT k.key, count(*) FROM metric_keys k WHERE k.run_id IN (SELECT DISTINCT c.run_id"
        " FROM checkpoints c JOIN runs r ON r.id = c.run_id LEFT JOIN jobs j ON j.id = r.job_id"
        f" WHERE {where}) AND {not_system('k.key')} GROUP BY k.key ORDER BY k.key", params)


# The value at the nearest step: the point at the checkpoint's own step when there is one
# (the usual case: a script logs and saves at the same step; one index seek), else the
# nearer of the points below and above it (CASE runs those seeks only then). The key is
# looked up once per run, not once per checkpoint.
_CANDIDATES = """
WITH rk AS MATERIALIZED (
    SELECT r.id AS run_id, k.id AS key_id
    FROM runs r LEFT JOIN jobs j ON j.id = r.job_id
    LEFT JOIN metric_keys k ON k.run_id = r.id AND k.key = ?
    WHERE {where}
)
SELECT c.id, c.run_id, c.step, rk.key_id, p.step, p.value,
       (SELECT pruned_step FROM metric_rollup WHERE key_id = rk.key_id),
       CASE WHEN p.step IS NULL THEN
           (SELECT step FROM points WHERE key_id = rk.key_id AND step < c.step
            ORDER BY step DESC LIMIT 1) END,
       CASE WHEN p.step IS NULL THEN
           (SELECT step FROM points WHERE key_id = rk.key_id AND step > c.step
            ORDER BY step LIMIT 1) END
FROM rk JOIN checkpoints c ON c.run_id = rk.run_id AND c.deleted_at IS NULL
    AND c.replaced_at IS NULL
LEFT JOIN points p ON p.key_id = rk.key_id AND p.step = c.step
"""

_EVAL_VALUES = """
SELECT e.checkpoint_id, e.id, p.value
FROM evaluations e JOIN jobs j ON j.id = e.job_id AND j.state = 'SUCCEEDED'
JOIN metric_keys k ON k.run_id = j.run_id AND k.key = ?
JOIN points p ON p.key_id = k.id AND p.step = (SELECT max(step) FROM points WHERE key_id = k.id)
WHERE e.checkpoint_id IN (SELECT c.id FROM checkpoints c JOIN runs r ON r.id = c.run_id
                          LEFT JOIN jobs j ON j.id = r.job_id WHERE {where})
ORDER BY e.id
"""


def candidates(db, key, run_id=None, project=None, experiment=None, sweep_id=None):
    """Every checkpoint in the scope with its values of `key`: `training`, the run's value
    at the nearest step (`at_step`; the earlier on a tie), and `evaluation`, the result of
    the last successful evaluation that logged `key` (`evaluation_id`). None: no value,
    or NaN. Paths are not read here (see paths())."""
    where, params = _scope_sql(run_id, project, experiment, sweep_id=sweep_id)
    evals = {}
    for ckpt_id, eval_id, value in db.query(_EVAL_VALUES.format(where=where), (key, *params)):
        evals[ckpt_id] = (eval_id, value)      # ordered by id: the last one wins
    rwhere, rparams = _scope_sql(run_id, project, experiment, alias="r", sweep_id=sweep_id)
    out, todo = [], []
    with db.read() as conn:
        cur = conn.cursor()
        cur.row_factory = None          # plain tuples: thousands of rows, read once
        rows = cur.execute(_CANDIDATES.format(where=rwhere), (key, *rparams)).fetchall()
    for cid, rid, step, key_id, exact, value, pruned, lo, hi in rows:
        at = exact
        if at is None and step is not None and (lo is not None or hi is not None):
            at = hi if lo is None else lo if hi is None or step - lo <= hi - step else hi
            if from_pruned(step, at, pruned):
                at = None           # never a value from another step (see from_pruned)
            else:
                todo.append((key_id, at, len(out)))
        eval_id, eval_value = evals.get(cid, (None, None))
        out.append({"id": cid, "run_id": rid, "step": step, "training": value,
                    "at_step": at, "evaluation": eval_value, "evaluation_id": eval_id})
    for i in range(0, len(todo), 300):        # values at the nearest steps, in batches
        part = todo[i:i + 300]
        found = dict(((k, s), v) for k, s, v in db.query(
            "SELECT key_id, step, value FROM points WHERE (key_id, step) IN (VALUES "
            + ",".join(["(?, ?)"] * len(part)) + ")",
            [x for k, s, _ in part for x in (k, s)]))
        for k, s, idx in part:
            out[idx]["training"] = found.get((k, s))
    return out


def paths(db, checkpoint_ids):
    """{id: (path, epoch)} of some checkpoints."""
    ids = list(checkpoint_ids)
    out = {}
    for i in range(0, len(ids), 500):
        part = ids[i:i + 500]
        out.update((r[0], (r[1], r[2])) for r in db.query(
            f"SELECT id, path, epoch FROM checkpoints WHERE id IN ({','.join('?' * len(part))})",
            part))
    return out


def eval_commands(db, checkpoint_ids):
    """{id: the evaluation command of the job that saved it, or None} of some checkpoints:
    whether evaluate_checkpoint can run without being given one."""
    ids = list(checkpoint_ids)
    out = {}
    for i in range(0, len(ids), 500):
        part = ids[i:i + 500]
        out.update((r[0], loads(r[1])) for r in db.query(
            "SELECT c.id, j.eval_command FROM checkpoints c JOIN runs r ON r.id = c.run_id"
            " LEFT JOIN jobs j ON j.id = r.job_id"
            f" WHERE c.id IN ({','.join('?' * len(part))})", part))
    return out


def latest_results(db, checkpoint_id):
    """{key: value} of the checkpoint's last successful evaluation, or None."""
    row = db.query_one("SELECT j.run_id FROM evaluations e JOIN jobs j ON j.id = e.job_id"
                       " WHERE e.checkpoint_id = ? AND j.state = 'SUCCEEDED'"
                       " ORDER BY e.id DESC LIMIT 1", (checkpoint_id,))
    if row is None or row[0] is None:
        return None
    return {k: v["value"] for k, v in _latest_values(db, row[0]).items()}
