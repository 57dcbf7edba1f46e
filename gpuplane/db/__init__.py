"""The only place that speaks SQL.

`Database` owns the file: schema and forward migrations (PRAGMA user_version), a fixed
pool of reader connections lent for one `query()` or a `with db.read() as conn:` block,
and `tx()` for writes — an IMMEDIATE transaction on the one writer connection under a
process-wide lock, so there is one writer at a time and readers never block (WAL). No
thread keeps a connection between blocks, so the file descriptors stay the same however
many threads the server runs (READERS says why that needs a fixed pool).
The query functions live beside this module, one module per noun (jobs, runs, nodes,
logs, metrics, tokens, events, checkpoints).

The transaction convention (followed by every module here):
- A function whose first argument is `conn` runs inside the CALLER's transaction: it
  neither begins nor commits. The caller opened it with `with db.tx() as conn:` and
  decides what else commits together with it (gpuplane/lifecycle.py writes a state and
  its event that way; the gateway writes a whole agent batch and its cursor).
- A function whose first argument is `db` (the `Database`) and that writes opens its own
  transaction (`with db.tx()`); one that only reads uses `db.query()` or `db.read()`,
  which inside a transaction (or a read block) use the connection this thread holds, so
  it sees that transaction's writes.
- `tx()` does not nest: calling it while this thread is already in a transaction
  raises, instead of silently joining the outer one. Pass `conn` down.
- Fetch inside the block: a cursor must not outlive `read()` (its connection goes back to
  the pool; rows already fetched are plain values and stay valid).
Nothing outside gpuplane/db/ writes SQL text (tests/test_layers.py checks).
"""
import contextlib
import json
import logging
import math
import os
import sqlite3
import threading
import time
import weakref

from .. import vocab

log = logging.getLogger(__name__)


def not_system(col):
    """SQL: `col` (a metric key) is not a system key, by vocab.SYSTEM_PREFIXES (GLOB is
    case-sensitive, as str.startswith is)."""
    return "(" + " AND ".join(f"{col} NOT GLOB '{p}*'" for p in vocab.SYSTEM_PREFIXES) + ")"


def now_ms():
    return int(time.time() * 1000)


SCHEMA_V1 = """
CREATE TABLE tokens (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL,
    scope       TEXT NOT NULL,             -- admin | write | read | agent | ingest
    secret_hash TEXT NOT NULL UNIQUE,
    run_id      INTEGER,                   -- ingest tokens: the one run they may write
    created_at  INTEGER NOT NULL,
    revoked     INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE nodes (
    name          TEXT PRIMARY KEY,
    hostname      TEXT,
    version       TEXT,
    fake          INTEGER NOT NULL DEFAULT 0,
    cpu_slots     INTEGER NOT NULL DEFAULT 4,
    gpus          TEXT NOT NULL DEFAULT '[]',   -- json: static GPU facts from hello
    stats         TEXT,                         -- json: last node_stats record
    state         TEXT NOT NULL DEFAULT 'disconnected',
    synced        INTEGER NOT NULL DEFAULT 0,   -- reconciled since the last connect
    epoch         TEXT,
    cursor        INTEGER NOT NULL DEFAULT 0,   -- highest outbox seq applied in epoch
    connected_at  INTEGER,
    disconnected_at INTEGER,
    last_seen     INTEGER
);

CREATE TABLE jobs (
    id               INTEGER PRIMARY KEY,
    name             TEXT NOT NULL,
    kind             TEXT NOT NULL DEFAULT 'TRAIN',
    command          TEXT NOT NULL,             -- json argv list
    working_dir      TEXT NOT NULL,
    gpus             INTEGER NOT NULL DEFAULT 0,
    cpu_only         INTEGER NOT NULL DEFAULT 0,
    priority         INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL DEFAULT 3,
    attempt          INTEGER NOT NULL DEFAULT 0,
    env              TEXT NOT NULL DEFAULT '{}',
    project          TEXT NOT NULL DEFAULT 'default',
    experiment       TEXT NOT NULL DEFAULT '',
    tb_dir           TEXT,
    watch_dir        TEXT,
    state            TEXT NOT NULL DEFAULT 'QUEUED',
    node             TEXT,
    gpu_indices      TEXT,                      -- json list
    run_id           INTEGER,
    pending_reason   TEXT,
    failure_kind     TEXT,
    exit_code        INTEGER,
    message          TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    parent_checkpoint_id INTEGER,
    created_at       INTEGER NOT NULL,
    queued_at        INTEGER NOT NULL,
    started_at       INTEGER,
    ended_at         INTEGER
);
CREATE INDEX jobs_state ON jobs(state, priority, queued_at);

CREATE TABLE runs (
    id           INTEGER PRIMARY KEY,
    job_id       INTEGER,
    attempt      INTEGER,
    source       TEXT NOT NULL DEFAULT 'job',   -- job | sdk | import
    state        TEXT NOT NULL,
    project      TEXT NOT NULL DEFAULT 'default',
    experiment   TEXT NOT NULL DEFAULT '',
    name         TEXT NOT NULL DEFAULT '',
    config       TEXT NOT NULL DEFAULT '{}',
    node         TEXT,
    gpu_indices  TEXT,
    exit_code    INTEGER,
    failure_kind TEXT,
    created_at   INTEGER NOT NULL,
    started_at   INTEGER,
    ended_at     INTEGER
);
CREATE INDEX runs_job ON runs(job_id, attempt);

CREATE TABLE logs (
    id       INTEGER PRIMARY KEY,
    job_id   INTEGER NOT NULL,
    attempt  INTEGER NOT NULL,
    line_no  INTEGER NOT NULL,
    ts       INTEGER NOT NULL,
    text     TEXT NOT NULL,
    UNIQUE (job_id, attempt, line_no)
);
CREATE INDEX logs_job ON logs(job_id, id);

CREATE TABLE metric_keys (
    id      INTEGER PRIMARY KEY,
    run_id  INTEGER NOT NULL,
    key     TEXT NOT NULL,
    UNIQUE (run_id, key)
);

CREATE TABLE points (
    key_id  INTEGER NOT NULL,
    step    INTEGER NOT NULL,
    value   REAL,
    ts      INTEGER NOT NULL,
    PRIMARY KEY (key_id, step)
) WITHOUT ROWID;

CREATE TABLE checkpoints (
    id          INTEGER PRIMARY KEY,
    run_id      INTEGER NOT NULL,
    path        TEXT NOT NULL,
    step        INTEGER,
    epoch       REAL,
    size_bytes  INTEGER,
    fingerprint TEXT,
    created_at  INTEGER NOT NULL,
    UNIQUE (run_id, path, fingerprint)
);

CREATE TABLE events (
    id        INTEGER PRIMARY KEY,
    run_id    INTEGER,
    job_id    INTEGER,
    node      TEXT,
    type      TEXT NOT NULL,
    severity  TEXT NOT NULL DEFAULT 'info',
    message   TEXT NOT NULL DEFAULT '',
    data      TEXT NOT NULL DEFAULT '{}',
    step      INTEGER,
    ts        INTEGER NOT NULL
);
CREATE INDEX events_run ON events(run_id, id);
"""

# Metric rollups (gpuplane/rollup.py, docs/metrics.md): per key, fixed-width step buckets
# of width 16, 64, 256, ... (bucket = step // width). A NULL value anywhere means NaN.
# Ingest appends one metric_dirty row per key per batch; the rollup thread recomputes the
# buckets those step ranges touch and advances metric_rollup.rolled_step.
SCHEMA_V2_ROLLUPS = """
CREATE TABLE rollups (
    key_id     INTEGER NOT NULL,
    width      INTEGER NOT NULL,
    bucket     INTEGER NOT NULL,
    first_step INTEGER NOT NULL,
    last_step  INTEGER NOT NULL,
    min        REAL,
    max        REAL,
    sum        REAL,
    count      INTEGER NOT NULL,   -- points in the bucket
    vcount     INTEGER NOT NULL,   -- of which not NaN
    last       REAL,               -- value at last_step
    PRIMARY KEY (key_id, width, bucket)
) WITHOUT ROWID;

CREATE TABLE metric_rollup (
    key_id       INTEGER PRIMARY KEY,
    rolled_step  INTEGER NOT NULL DEFAULT -1,  -- steps <= this are in the rollups
    top_width    INTEGER NOT NULL DEFAULT 0,   -- coarsest level built
    pruned_step  INTEGER NOT NULL DEFAULT -1   -- raw points may be gone at steps <= this
);

CREATE TABLE metric_dirty (
    id      INTEGER PRIMARY KEY,
    key_id  INTEGER NOT NULL,
    lo      INTEGER NOT NULL,
    hi      INTEGER NOT NULL
);
"""

# Job dependencies and holds (gpuplane/lifecycle.py, docs/cli.md): a queued job starts only
# after the jobs in `depends_on` succeeded (or ended in any state with depends_any); a held
# job is skipped by the scheduler until released.
SCHEMA_V3_JOB_DEPENDENCIES = """
ALTER TABLE jobs ADD COLUMN depends_on TEXT NOT NULL DEFAULT '[]';
ALTER TABLE jobs ADD COLUMN depends_any INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN held INTEGER NOT NULL DEFAULT 0;
"""

# Projects, experiments, checkpoints as one record per file, evaluations, metric
# definitions, run tags (docs/checkpoints.md). Runs and jobs name their project and
# experiment (the text columns they always had); these tables hold what a name carries.
SCHEMA_V4_CHECKPOINTS = """
CREATE TABLE projects (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    description TEXT NOT NULL DEFAULT '',
    archived    INTEGER NOT NULL DEFAULT 0,
    created_at  INTEGER NOT NULL
);

CREATE TABLE experiments (
    id          INTEGER PRIMARY KEY,
    project     TEXT NOT NULL,
    name        TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    archived    INTEGER NOT NULL DEFAULT 0,
    created_at  INTEGER NOT NULL,
    UNIQUE (project, name)
);

INSERT OR IGNORE INTO projects (name, created_at)
    SELECT project, min(created_at) FROM runs GROUP BY project;
INSERT OR IGNORE INTO projects (name, created_at)
    SELECT project, min(created_at) FROM jobs GROUP BY project;
INSERT OR IGNORE INTO projects (name, created_at)
    VALUES ('default', CAST(strftime('%s', 'now') AS INTEGER) * 1000);
INSERT OR IGNORE INTO experiments (project, name, created_at)
    SELECT project, experiment, min(created_at) FROM runs WHERE experiment != ''
    GROUP BY project, experiment;
INSERT OR IGNORE INTO experiments (project, name, created_at)
    SELECT project, experiment, min(created_at) FROM jobs WHERE experiment != ''
    GROUP BY project, experiment;

ALTER TABLE runs ADD COLUMN tags TEXT NOT NULL DEFAULT '[]';
CREATE INDEX runs_experiment ON runs(project, experiment);
ALTER TABLE jobs ADD COLUMN eval_command TEXT;       -- json argv for evaluations, or NULL

-- One checkpoint per (run, path): the SDK and the agent's watcher seeing the same file
-- update one row. step_source says where the step came from, the strongest kept:
-- given (the SDK's step) > name (parsed from the file name) > latest (the run's latest
-- step when it was registered) > none.
CREATE TABLE checkpoints_v3 (
    id          INTEGER PRIMARY KEY,
    run_id      INTEGER NOT NULL,
    path        TEXT NOT NULL,
    step        INTEGER,
    step_source TEXT NOT NULL DEFAULT 'none',
    epoch       REAL,
    size_bytes  INTEGER,
    fingerprint TEXT,
    format      TEXT,
    source      TEXT NOT NULL DEFAULT 'sdk',        -- sdk | watcher | import
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    UNIQUE (run_id, path)
);
INSERT INTO checkpoints_v3 (id, run_id, path, step, step_source, epoch, size_bytes,
                            fingerprint, source, created_at, updated_at)
    SELECT max(id), run_id, path, step, CASE WHEN step IS NULL THEN 'none' ELSE 'given' END,
           epoch, size_bytes, fingerprint,
           CASE WHEN fingerprint LIKE 'sdk:%' THEN 'sdk' ELSE 'watcher' END,
           created_at, created_at
    FROM checkpoints GROUP BY run_id, path;
DROP TABLE checkpoints;
ALTER TABLE checkpoints_v3 RENAME TO checkpoints;
CREATE INDEX checkpoints_run ON checkpoints(run_id, step);

-- An evaluation is an EVALUATE job of one checkpoint. Its state is the job's (QUEUED,
-- RUNNING, SUCCEEDED, FAILED), and its results are what the job's run logged: neither
-- is copied here, so they cannot disagree with the job.
CREATE TABLE evaluations (
    id            INTEGER PRIMARY KEY,
    checkpoint_id INTEGER NOT NULL,
    job_id        INTEGER NOT NULL UNIQUE,
    command       TEXT NOT NULL,                    -- json argv
    created_at    INTEGER NOT NULL
);
CREATE INDEX evaluations_checkpoint ON evaluations(checkpoint_id, id);

-- Direction and primary flag of a metric key at one scope: global (project = ''),
-- a project (experiment = '') or an experiment. Resolved experiment -> project -> global.
CREATE TABLE metric_definitions (
    id          INTEGER PRIMARY KEY,
    key         TEXT NOT NULL,
    project     TEXT NOT NULL DEFAULT '',
    experiment  TEXT NOT NULL DEFAULT '',
    direction   TEXT,                               -- min | max | NULL: inherit
    is_primary  INTEGER NOT NULL DEFAULT 0,
    description TEXT NOT NULL DEFAULT '',
    updated_at  INTEGER NOT NULL,
    UNIQUE (project, experiment, key)
);
"""

# A job may run in a container (the agent's DockerRunner, docs/docker.md): its image.
SCHEMA_V5_JOB_IMAGE = """
ALTER TABLE jobs ADD COLUMN image TEXT;
"""

# The event engine (gpuplane/events.py, docs/events.md): a debounced event is one row whose
# `count` grows with each repeat inside the window (`last_ts` the latest); `fingerprint`
# names what triggered a finding (rule, run, key, step) so the same point seen again —
# a replay, a restart — never adds a second row.
SCHEMA_V6_EVENTS = """
ALTER TABLE events ADD COLUMN count INTEGER NOT NULL DEFAULT 1;
ALTER TABLE events ADD COLUMN last_ts INTEGER;
ALTER TABLE events ADD COLUMN fingerprint TEXT;
CREATE UNIQUE INDEX events_fingerprint ON events(fingerprint) WHERE fingerprint IS NOT NULL;
CREATE INDEX events_job ON events(job_id, id);
CREATE INDEX events_node_type ON events(node, type, id);
"""

# Agent tokens are bound to one node name (docs/security.md): the gateway refuses a hello
# with another name. NULL for other scopes (an admin token may act as any node).
SCHEMA_V7_TOKEN_NODE = """
ALTER TABLE tokens ADD COLUMN node TEXT;
"""

# A rollup bucket's time (docs/metrics.md): first_ts is the earliest ts of its points, so a
# downsampled series can be drawn on a wall-clock axis. Buckets written before are
# backfilled here: the base level from its raw points, each level above from the four
# below it, finest first (a bucket whose raw points were pruned keeps NULL: no time). The
# `key_id IN` keeps every UPDATE to index seeks on the keys that have that level.
SCHEMA_V8_ROLLUP_TS = """
ALTER TABLE rollups ADD COLUMN first_ts INTEGER;
UPDATE rollups SET first_ts = (
    SELECT min(p.ts) FROM points AS p
    WHERE p.key_id = rollups.key_id AND p.step BETWEEN rollups.first_step AND rollups.last_step)
WHERE width = 16 AND key_id IN (SELECT key_id FROM metric_rollup);
""" + "".join(f"""
UPDATE rollups SET first_ts = (
    SELECT min(c.first_ts) FROM rollups AS c WHERE c.key_id = rollups.key_id
    AND c.width = {w // 4} AND c.bucket BETWEEN rollups.bucket * 4 AND rollups.bucket * 4 + 3)
WHERE width = {w} AND key_id IN (SELECT key_id FROM metric_rollup WHERE top_width >= {w});
""" for w in (4**j for j in range(3, 32)))

# Forward migrations: MIGRATIONS[i] takes a database at user_version i to i + 1.
# A metric_dirty row whose base buckets the ingest already wrote (a batch that appends to
# its key, gpuplane/db/metrics.py): the rollup builds only the levels above from them.
SCHEMA_V9_DIRTY_BASE = """
ALTER TABLE metric_dirty ADD COLUMN base INTEGER NOT NULL DEFAULT 0;
"""

# Sweeps (gpuplane/sweeps.py, docs/sweeps.md): a sweep and its trials, one row per trial
# from the start (its parameters drawn once, at create), `job_id` set when the trial is
# launched as an ordinary job. A job carries `config` (merged into each attempt's
# run.config: a trial's parameters), `sweep_id`, and `stop_reason` (JSON: why a cancel was
# asked for, such as an early stop, so the CANCELLED event can say it).
SCHEMA_V10_SWEEPS = """
CREATE TABLE sweeps (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL,
    project     TEXT NOT NULL DEFAULT 'default',
    experiment  TEXT NOT NULL DEFAULT '',
    spec        TEXT NOT NULL,                  -- json: the validated spec
    state       TEXT NOT NULL DEFAULT 'RUNNING',  -- RUNNING | STOPPED | DONE | CANCELLED
    stop_reason TEXT,
    created_at  INTEGER NOT NULL,
    ended_at    INTEGER
);
CREATE TABLE sweep_trials (
    id        INTEGER PRIMARY KEY,
    sweep_id  INTEGER NOT NULL,
    number    INTEGER NOT NULL,                 -- 0, 1, ... in the order they launch
    params    TEXT NOT NULL,                    -- json
    job_id    INTEGER,                          -- NULL until launched
    rung      INTEGER NOT NULL DEFAULT 0,       -- ASHA rungs passed
    stopped   TEXT,                             -- json: the early-stopping decision
    retry     INTEGER NOT NULL DEFAULT 0,       -- queued again by sweep retry-failed
    UNIQUE (sweep_id, number)
);
CREATE INDEX sweep_trials_job ON sweep_trials(job_id);
ALTER TABLE jobs ADD COLUMN config TEXT;
ALTER TABLE jobs ADD COLUMN sweep_id INTEGER;
ALTER TABLE jobs ADD COLUMN stop_reason TEXT;
"""

# Slurm (docs/slurm.md): a node's runner and what its partition offers (sinfo, json); the
# Slurm job id of an attempt; what a job asks of Slurm besides GPUs (CPUs per task, memory,
# time limit; a local agent ignores them).
SCHEMA_V11_SLURM = """
ALTER TABLE nodes ADD COLUMN runner TEXT NOT NULL DEFAULT 'process';
ALTER TABLE nodes ADD COLUMN slurm TEXT;
ALTER TABLE runs ADD COLUMN slurm_job_id TEXT;
ALTER TABLE jobs ADD COLUMN cpus INTEGER;
ALTER TABLE jobs ADD COLUMN mem_mb INTEGER;
ALTER TABLE jobs ADD COLUMN time_limit_min INTEGER;
"""

# Resume and checkpoint retention (docs/sweeps.md, docs/checkpoints.md): a job whose next
# attempt resumes from its last checkpoint (`resume`, set by a platform retry or a retry
# asked to resume), the checkpoint a run resumed from; a checkpoint pinned by hand, deleted
# by retention (when, the bytes freed) and why retention keeps one.
SCHEMA_V12_RESUME = """
ALTER TABLE jobs ADD COLUMN resume INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN resumed_from INTEGER;
ALTER TABLE checkpoints ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0;
ALTER TABLE checkpoints ADD COLUMN deleted_at INTEGER;
ALTER TABLE checkpoints ADD COLUMN bytes_freed INTEGER;
ALTER TABLE checkpoints ADD COLUMN keep_reason TEXT;
"""

# A run says whether it is a training or an evaluation (of which checkpoint), as its job
# does: run lists keep evaluations apart from the trainings they score. Runs of EVALUATE
# jobs written before are marked from their job.
SCHEMA_V13_RUN_KIND = """
ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'TRAIN';
ALTER TABLE runs ADD COLUMN parent_checkpoint_id INTEGER;
UPDATE runs SET kind = 'EVALUATE', parent_checkpoint_id = (
    SELECT j.parent_checkpoint_id FROM jobs AS j WHERE j.id = runs.job_id)
WHERE job_id IN (SELECT id FROM jobs WHERE kind = 'EVALUATE');
CREATE INDEX runs_kind ON runs (kind, id);
"""

# A job's checkpoint retention policy (json {"keep_best", "keep_last"}; docs/checkpoints.md).
SCHEMA_V14_RETENTION = """
ALTER TABLE jobs ADD COLUMN retention TEXT;
"""

# An experiment's checkpoint retention policy: its jobs without one of their own use it
# (json {"keep_best", "keep_last"}; docs/checkpoints.md).
SCHEMA_V15_EXPERIMENT_RETENTION = """
ALTER TABLE experiments ADD COLUMN retention TEXT;
"""

# The queue in placement order (scheduler.py reads it a page at a time): the index walks it
# in that order and stops at the page, where jobs_state (priority ascending) made SQLite
# sort every queued job for each page (10 ms a pass with 5000 queued).
SCHEMA_V16_QUEUE_ORDER = """
CREATE INDEX jobs_queue ON jobs(state, priority DESC, queued_at, id);
"""

# Time limits, backfill and preemption (gpuplane/scheduler.py, docs/scheduling.md): a
# job's limit in seconds (time_limit_min, from the Slurm runner's first version, was whole
# minutes and is carried over), the warning signal before it ("USR1@60"), whether it may be
# preempted and which job preempted it last; a project's default and largest limit and
# whether its jobs are preemptible by default.
SCHEMA_V17_TIME_LIMITS = """
ALTER TABLE jobs ADD COLUMN time_limit_s INTEGER;
ALTER TABLE jobs ADD COLUMN time_signal TEXT;
ALTER TABLE jobs ADD COLUMN preemptible INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN preempted_by INTEGER;
UPDATE jobs SET time_limit_s = time_limit_min * 60 WHERE time_limit_min IS NOT NULL;
ALTER TABLE projects ADD COLUMN time_limit_s INTEGER;
ALTER TABLE projects ADD COLUMN max_time_limit_s INTEGER;
ALTER TABLE projects ADD COLUMN preemptible INTEGER;
"""

# Whose data is it (docs/checkpoints.md, "A checkpoint is its content"): a checkpoint
# records the file's mtime and a content fingerprint when registered; a rewrite of the
# file marks the old record replaced (kept, never re-pointed) and by which record or why.
# A job records whether its submitter named its project / experiment (an explicit name
# wins over the script's run.init; none given, run.init may name it for the job too), and
# a run keeps what its script's run.init asked for where the job's names won.
SCHEMA_V18_ATTRIBUTION = """
ALTER TABLE checkpoints ADD COLUMN mtime_ns INTEGER;
ALTER TABLE checkpoints ADD COLUMN content TEXT;
ALTER TABLE checkpoints ADD COLUMN replaced_at INTEGER;
ALTER TABLE checkpoints ADD COLUMN replaced_by INTEGER;
ALTER TABLE checkpoints ADD COLUMN replaced_why TEXT;
CREATE INDEX checkpoints_path ON checkpoints(path);
ALTER TABLE jobs ADD COLUMN project_given INTEGER NOT NULL DEFAULT 1;
ALTER TABLE jobs ADD COLUMN experiment_given INTEGER NOT NULL DEFAULT 1;
ALTER TABLE runs ADD COLUMN init_wish TEXT;
"""

# Stop on events (docs/events.md): the event types that end a job at once.
SCHEMA_V19_STOP_ON = """
ALTER TABLE jobs ADD COLUMN stop_on TEXT;
"""

# When a queued job is expected to start (docs/scheduling.md: backfill's estimate).
SCHEMA_V20_EXPECTED_START = """
ALTER TABLE jobs ADD COLUMN expected_start INTEGER;
"""

# Optuna's samplers (gpuplane/samplers.py, docs/sweeps.md "Samplers"): a sampler's trial
# row is made at create with no parameters (NULL until they are asked, at launch), and
# keeps what the study was told when its job ended (json {"state", "value", "step"}), from
# which the study is rebuilt after a restart. SQLite cannot drop a NOT NULL: the table is
# made anew.
SCHEMA_V21_SAMPLERS = """
CREATE TABLE sweep_trials_v21 (
    id        INTEGER PRIMARY KEY,
    sweep_id  INTEGER NOT NULL,
    number    INTEGER NOT NULL,                 -- 0, 1, ... in the order they launch
    params    TEXT,                             -- json; NULL until a sampler is asked
    job_id    INTEGER,                          -- NULL until launched
    rung      INTEGER NOT NULL DEFAULT 0,       -- ASHA rungs passed
    stopped   TEXT,                             -- json: the early-stopping decision
    retry     INTEGER NOT NULL DEFAULT 0,       -- queued again by sweep retry-failed
    told      TEXT,                             -- json: what the sampler was told
    UNIQUE (sweep_id, number)
);
INSERT INTO sweep_trials_v21 (id, sweep_id, number, params, job_id, rung, stopped, retry)
    SELECT id, sweep_id, number, params, job_id, rung, stopped, retry FROM sweep_trials;
DROP TABLE sweep_trials;
ALTER TABLE sweep_trials_v21 RENAME TO sweep_trials;
CREATE INDEX sweep_trials_job ON sweep_trials(job_id);
"""

MIGRATIONS = [SCHEMA_V1, SCHEMA_V2_ROLLUPS, SCHEMA_V3_JOB_DEPENDENCIES, SCHEMA_V4_CHECKPOINTS,
              SCHEMA_V5_JOB_IMAGE, SCHEMA_V6_EVENTS, SCHEMA_V7_TOKEN_NODE, SCHEMA_V8_ROLLUP_TS,
              SCHEMA_V9_DIRTY_BASE, SCHEMA_V10_SWEEPS, SCHEMA_V11_SLURM, SCHEMA_V12_RESUME,
              SCHEMA_V13_RUN_KIND, SCHEMA_V14_RETENTION,
              SCHEMA_V15_EXPERIMENT_RETENTION, SCHEMA_V16_QUEUE_ORDER,
              SCHEMA_V17_TIME_LIMITS, SCHEMA_V18_ATTRIBUTION, SCHEMA_V19_STOP_ON,
              SCHEMA_V20_EXPECTED_START, SCHEMA_V21_SAMPLERS]


_databases: weakref.WeakSet = weakref.WeakSet()

# Reader connections per Database, opened with it. SQLite (unix VFS) cannot close the
# database file's descriptor of a closed connection while another connection of the
# process holds a lock on that file, which in WAL mode every open connection does: it
# keeps the descriptor for the next open to reuse. So descriptors track the most
# connections ever open at once, and a connection per thread made them track the largest
# burst of threads. A fixed pool makes them a constant, whatever the load.
READERS = 8
CHECKOUT_WAIT_S = 30          # as long as a writer waits for the file lock (busy_timeout)


def close_thread_connections():
    """A thread that is about to exit (an idle HTTP pool thread) gives back any connection
    it still holds. Connections belong to the pool, not to threads, and a thread holds one
    only inside `db.read()` / `db.tx()`, so normally there is none."""
    for db in list(_databases):
        db.release_thread()


class NestedTransaction(RuntimeError):
    """db.tx() was called inside a transaction of the same thread."""


class LimitExceeded(ValueError):
    """A write that would take a run or node past a stored limit (docs/security.md,
    "Limits"); the message names the limit. The API answers 413, the gateway skips the
    record with a warning."""


class PoolTimeout(sqlite3.OperationalError):
    """Every reader connection stayed checked out for CHECKOUT_WAIT_S."""


class ReadDeadline(PoolTimeout):
    """One borrowing of a reader (a query, or a read() block) ran past READ_DEADLINE_S:
    SQLite interrupted it, so no request holds a reader for longer (a 503 like the pool
    running dry)."""


READ_DEADLINE_S = 30
_PROGRESS_OPS = 20_000         # SQLite VM steps between two looks at the clock


class Database:
    """The database file and its connections: one writer, used only under the write lock,
    and a fixed pool of `readers`. A thread holds a connection only for a `read()` block,
    a `tx()`, or one `query()`; inside either block, `conn`, `query()` and a nested
    `read()` use the connection it holds, so reads inside a transaction see its writes."""

    def __init__(self, path, readers=READERS, read_deadline_s=READ_DEADLINE_S):
        self.path = str(path)
        self.read_deadline_s = read_deadline_s
        self._deadlines = {}     # reader connection -> [monotonic deadline of its borrower]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._local = threading.local()      # .conn: the connection this thread holds
        self._write_lock = threading.Lock()
        self.write_error = None      # why the last write failed (disk full, read-only)
        self.migrate()
        self._pool = threading.Condition()
        self._closed = False
        self._writer = self._connect()
        self._idle = [self._reader() for _ in range(readers)]
        _databases.add(self)

    def _connect(self):
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                               check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=30000")
        # Reads through a memory map (shared by every connection through the OS page
        # cache) instead of a read() per page: random seeks into a big points table, as
        # a recommendation over thousands of checkpoints does, cost a third less CPU.
        conn.execute("PRAGMA mmap_size=2147418112")
        conn.execute("PRAGMA foreign_keys=OFF")
        return conn

    @property
    def conn(self):
        """The connection this thread holds inside `read()` or `tx()`."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            raise RuntimeError("db.conn outside a `with db.read()` or `with db.tx()` block; "
                               "open one, or use db.query() / db.query_one()")
        return conn

    def migrate(self):
        conn = self._connect()
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"{self.path} has schema version {version}, newer than this GPUPlane "
                    f"knows ({len(MIGRATIONS)}); upgrade GPUPlane")
            for i in range(version, len(MIGRATIONS)):
                log.info("migrating %s to schema version %d", self.path, i + 1)
                conn.executescript("BEGIN IMMEDIATE;\n" + MIGRATIONS[i]
                                   + f"\nPRAGMA user_version={i + 1};\nCOMMIT;")
        finally:
            conn.close()

    # -- the reader pool -------------------------------------------------------------------

    def _reader(self):
        conn = self._connect()
        box = [math.inf]
        conn.set_progress_handler(lambda: time.monotonic() > box[0], _PROGRESS_OPS)
        self._deadlines[conn] = box
        return conn

    def _expired(self, conn, e):
        """The ReadDeadline for an OperationalError SQLite raised on an interrupted read."""
        box = self._deadlines.get(conn)
        if box is None or "interrupt" not in str(e) or time.monotonic() <= box[0]:
            return None
        return ReadDeadline(f"a database read ran past {self.read_deadline_s:g} s and was "
                            "stopped; ask for less (a smaller limit, fewer runs or keys)")

    def _checkout(self):
        with self._pool:
            if not self._pool.wait_for(lambda: self._idle or self._closed, CHECKOUT_WAIT_S):
                raise PoolTimeout(f"no database connection came free in {CHECKOUT_WAIT_S} s")
            if self._closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            conn = self._idle.pop()
            self._deadlines[conn][0] = time.monotonic() + self.read_deadline_s
            return conn

    def _checkin(self, conn, failed=False):
        box = self._deadlines.get(conn)
        if box is not None:
            box[0] = math.inf
        if failed or conn.in_transaction:
            # A read that raised may have left a statement (and with it an old snapshot)
            # open on the connection: the next borrower gets a fresh one instead. The
            # closed one's descriptor is reused by the open (see READERS).
            self._deadlines.pop(conn, None)
            conn.close()
            conn = None if self._closed else self._reader()
        with self._pool:
            if self._closed:
                if conn is not None:
                    conn.close()
                return
            self._idle.append(conn)
            self._pool.notify()

    @contextlib.contextmanager
    def read(self):
        """A connection for several reads: the one this thread holds (its transaction's),
        or one from the pool until the block ends. Fetch what you need inside the block."""
        held = getattr(self._local, "conn", None)
        if held is not None:
            yield held
            return
        conn = self._checkout()
        self._local.conn = conn
        failed = True
        try:
            try:
                yield conn
            except sqlite3.OperationalError as e:
                late = self._expired(conn, e)
                if late is not None:
                    raise late from None
                raise
            failed = False
        finally:
            self._local.conn = None
            self._checkin(conn, failed)

    def release_thread(self):
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and conn is not self._writer:
            self._checkin(conn, failed=True)

    # -- writes ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def tx(self, durable=False):
        """One write transaction (BEGIN IMMEDIATE); commits on success, rolls back on error.

        durable: the commit is fsynced before this returns (synchronous=FULL), for the
        transactions after which an agent forgets what it sent (the outbox ack); the rest
        use NORMAL, which may lose the last commits on power loss but never corrupts."""
        held = getattr(self._local, "conn", None)
        if held is not None and (held is self._writer or held.in_transaction):
            # Joining quietly would make the inner caller believe its writes are
            # committed when the outer transaction may still roll them back.
            raise NestedTransaction(
                "db.tx() inside a transaction; call the function that takes `conn` "
                "with the outer transaction's connection instead")
        with self._write_lock:
            conn = self._writer
            if conn is None:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
            self._local.conn = conn
            try:
                if durable:
                    conn.execute("PRAGMA synchronous=FULL")
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                if is_write_failure(e):
                    self.write_error = str(e)
                raise
            else:
                self.write_error = None
            finally:
                self._local.conn = held
                if durable:
                    conn.execute("PRAGMA synchronous=NORMAL")

    def probe_write(self):
        """After a failed write: can the file be written again? (Rewrites page 1.)"""
        try:
            with self.tx() as c:
                v = c.execute("PRAGMA user_version").fetchone()[0]
                c.execute(f"PRAGMA user_version = {int(v)}")
        except sqlite3.Error:
            pass
        return self.write_error

    def query(self, sql, params=()):
        return self._read(sql, params, "fetchall")

    def query_one(self, sql, params=()):
        return self._read(sql, params, "fetchone")

    def _read(self, sql, params, fetch):
        """One statement on the connection this thread holds, or on a reader lent for it."""
        held = getattr(self._local, "conn", None)
        if held is not None:
            return getattr(held.execute(sql, params), fetch)()
        conn = self._checkout()
        failed = True
        try:
            result = getattr(conn.execute(sql, params), fetch)()
            failed = False
            return result
        except sqlite3.OperationalError as e:
            late = self._expired(conn, e)
            if late is not None:
                raise late from None
            raise
        finally:
            self._checkin(conn, failed)

    def close(self):
        """Close every connection; one still checked out is closed when it comes back."""
        with self._write_lock, self._pool:
            self._closed = True
            idle, self._idle = self._idle, []
            writer, self._writer = self._writer, None
            self._pool.notify_all()
        for conn in idle + [writer]:
            if conn is not None:
                conn.close()


@contextlib.contextmanager
def savepoint(conn, name="sp"):
    """A part of the caller's transaction that rolls back alone on an exception (which is
    re-raised): one bad record of an agent's batch must not undo the others."""
    conn.execute(f"SAVEPOINT {name}")
    try:
        yield conn
    except BaseException:
        conn.execute(f"ROLLBACK TO {name}")
        conn.execute(f"RELEASE {name}")
        raise
    conn.execute(f"RELEASE {name}")


def is_write_failure(e):
    """The database cannot be written (disk full, read-only file or directory, I/O error):
    the server's trouble, answered 503, and reported by /health."""
    name = getattr(e, "sqlite_errorname", "") or ""
    return isinstance(e, sqlite3.OperationalError) and name.startswith(
        ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN"))


def loads(text, default=None):
    if text is None:
        return default
    return json.loads(text)


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"))
