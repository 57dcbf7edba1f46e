"""Jobs: submit, list, show, cancel, retry, logs (tail and live SSE)."""
import json
import os
import posixpath
import re
import select
import socket
import time

from flask import Blueprint, Response, current_app, request

from .. import lifecycle, placeholders, retention, rules, states, timelimit
from ..auth import current_token, requires
from ..db import jobs, logs, runs
from ..errors import BadRequest, Conflict, NotFound, PayloadTooLarge
from .validate import body, field, query_ids, query_int, query_state
from . import current_db, current_lifecycle

bp = Blueprint("jobs", __name__, url_prefix="/api/v1")

STATES = states.JOB_STATES
SSE_KEEPALIVE_S = 15
MAX_COMMAND_BYTES = 32 * 1024      # the argv, each argument counted with its NUL
MAX_ENV_BYTES = 64 * 1024          # every NAME=value, with its NUL
REDACTED = "<redacted>"


def job_view(job, with_env=True):
    """A job as a client sees it: list views leave `env` out (it may be large, and it
    holds secrets); a read token sees the names with the values redacted."""
    job = dict(job)
    if not with_env:
        job.pop("env", None)
    elif current_token()["scope"] not in ("admin", "write"):
        job["env"] = {k: REDACTED for k in job.get("env") or {}}
    return job


def _job_or_404(job_id):
    job = jobs.get(current_db(), job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist; list jobs with `gpuplane job list`")
    return job


def stop_on(value):
    """The event types that end the job at once (docs/events.md, "Stop on events")."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [v for v in value.replace(",", " ").split() if v]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest("'stop_on' must be a list of event types, e.g. [\"LOSS_NAN\", "
                         "\"LOSS_DIVERGED\"]")
    unknown = [v for v in value if v not in rules.TYPES]
    if unknown:
        raise BadRequest(f"'stop_on' names unknown event type(s) {', '.join(unknown)}; "
                         f"a job can stop on {', '.join(rules.TYPES)}")
    return list(dict.fromkeys(value))


def parse_job_spec(data, placeholder_names=placeholders.JOB):
    """Validate a submit body into the spec lifecycle.submit() stores. `placeholder_names`:
    the {names} its folders may use (a sweep's template adds its own)."""
    command = data.get("command")
    if isinstance(command, str):
        if not command.strip():
            raise BadRequest("'command' is empty; give the program to run, e.g. "
                             "[\"python\", \"train.py\"]")
        command = ["/bin/sh", "-c", command]
    elif isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        if not command[0]:
            raise BadRequest("'command' starts with an empty program name")
    else:
        raise BadRequest("'command' is required: a list of strings (argv), e.g. "
                         "[\"python\", \"train.py\", \"--epochs\", \"3\"], or one shell string")
    size = sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in command)
    if size > MAX_COMMAND_BYTES:
        raise PayloadTooLarge(f"'command' is {size} bytes; the limit is {MAX_COMMAND_BYTES} "
                              "bytes (32 KiB): put long arguments in a file the job reads")
    if any("\0" in a for a in command):
        raise BadRequest("'command' contains a NUL byte, which no program can receive as an "
                         "argument; remove it")
    working_dir = field(data, "working_dir", str, max_len=4096)
    if "\0" in working_dir:
        raise BadRequest("'working_dir' contains a NUL byte; give a real path")
    if not posixpath.isabs(working_dir):
        raise BadRequest(f"'working_dir' must be an absolute path on the agent's host, got "
                         f"{working_dir!r}; the CLI's -d \"$PWD/...\" gives one")
    cpu_only = field(data, "cpu_only", bool, False)
    gpus = field(data, "gpus", int, 0 if cpu_only else 1, min=0, max=64)
    if cpu_only and gpus:
        raise BadRequest("a cpu_only job asks for no GPUs; drop 'gpus' or 'cpu_only'")
    if gpus == 0:
        cpu_only = True
    env = field(data, "env", dict, {})
    for k, v in env.items():
        if not isinstance(v, str) or not k or "=" in k or "\0" in k + v:
            raise BadRequest(f"'env' must map names to string values (no '=' in names); "
                             f"bad entry {k!r}"[:300])
    size = sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
               + 2 for k, v in env.items())
    if size > MAX_ENV_BYTES:
        raise PayloadTooLarge(f"'env' is {size} bytes; the limit is {MAX_ENV_BYTES} bytes "
                              "(64 KiB): pass large values as files the job reads")
    name = field(data, "name", str, "", max_len=200).strip() or os.path.basename(command[0])
    depends_on, depends_any = _dependencies(data)
    eval_command = data.get("eval_command")
    if isinstance(eval_command, str) and eval_command.strip():
        eval_command = ["/bin/sh", "-c", eval_command]
    elif eval_command is not None and not (
            isinstance(eval_command, list) and eval_command
            and all(isinstance(a, str) for a in eval_command) and eval_command[0]):
        raise BadRequest("'eval_command' must be an argv list of strings (or one shell "
                         "string): the command that evaluates one checkpoint")
    return {
        "name": name, "command": command, "working_dir": working_dir,
        "gpus": gpus, "cpu_only": cpu_only,
        "priority": field(data, "priority", int, 0, min=-1000, max=1000),
        "max_attempts": field(data, "max_attempts", int, 3, min=1, max=100),
        "env": env,
        "project": field(data, "project", str, "default", max_len=200) or "default",
        "experiment": field(data, "experiment", str, "", max_len=200),
        "tb_dir": _folder(data, "tb_dir", placeholder_names),
        "watch_dir": _folder(data, "watch_dir", placeholder_names),
        # whether the submitter named them: a name given wins over the script's run.init
        "project_given": data.get("project") not in (None, "", "default"),
        "experiment_given": bool(data.get("experiment")),
        "depends_on": depends_on, "depends_any": depends_any,
        "held": field(data, "held", bool, False),
        "eval_command": eval_command,
        "image": _image(data),
        # asked of Slurm by a Slurm agent (docs/slurm.md); a local agent ignores them
        "cpus": field(data, "cpus", int, None, min=1, max=4096, nullable=True),
        "mem_mb": field(data, "mem_mb", int, None, min=1, max=2**31, nullable=True),
        # the time limit (docs/scheduling.md): its warning, the stop, backfill's ends
        "time_limit_s": time_limit(data),
        "time_signal": time_signal(data),
        "preemptible": field(data, "preemptible", bool, None, nullable=True),
        "retention": _retention(data.get("retention")),
        "stop_on": stop_on(data.get("stop_on")),
    }


def _folder(data, key, names):
    value = field(data, key, str, None, max_len=4096, nullable=True)
    try:
        placeholders.check(value or "", names, where=f"'{key}'")
    except placeholders.PlaceholderError as e:
        raise BadRequest(str(e)) from None
    return value


def time_limit(data):
    """'time_limit' (a duration such as "2h", "90m", "1:30:00", or seconds),
    'time_limit_s' or 'time_limit_min' (whole minutes, as the Slurm runner first took it)
    -> seconds or None."""
    given = [k for k in ("time_limit", "time_limit_s", "time_limit_min")
             if data.get(k) is not None]
    if len(given) > 1:
        raise BadRequest(f"give one time limit, not {' and '.join(map(repr, given))}: "
                         "'time_limit' takes a duration such as \"2h\"")
    if not given:
        return None
    key = given[0]
    value = data[key]
    if key != "time_limit" and (not isinstance(value, int) or isinstance(value, bool)):
        raise BadRequest(f"'{key}' must be a whole number; or give 'time_limit' as a "
                         f"duration such as \"2h\"")
    try:
        return timelimit.parse(value * 60 if key == "time_limit_min" else value,
                               what=f"'{key}'")
    except timelimit.LimitError as e:
        raise BadRequest(str(e)) from None


def time_signal(data):
    """'time_signal': the warning before the limit, "USR1@60" (None: the server's)."""
    value = field(data, "time_signal", str, None, max_len=40, nullable=True)
    if value is None:
        return None
    try:
        name, lead = timelimit.parse_signal(value, 0)
    except timelimit.LimitError as e:
        raise BadRequest(str(e)) from None
    return f"{name}@{lead}" if "@" in value else name


def _retention(data):
    try:
        return retention.parse_policy(data)
    except retention.PolicyError as e:
        raise BadRequest(str(e)) from None


_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")


def _image(data):
    image = field(data, "image", str, None, max_len=255, nullable=True)
    if image is not None and not _IMAGE.match(image):
        raise BadRequest(f"'image' must be a container image reference such as "
                         f"\"pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime\", got {image[:80]!r}")
    return image


def _dependencies(data, job_id=None, required=False):
    """'after' (ids that must succeed first) or 'after_any' (ids that must end first):
    (ids, any?) checked against the jobs that exist; (None, None) when neither is given."""
    after, after_any = data.get("after"), data.get("after_any")
    if after is not None and after_any is not None:
        raise BadRequest("give 'after' (start when those succeeded) or 'after_any' (start "
                         "when those ended in any state), not both")
    ids = after if after is not None else after_any
    if ids is None:
        return ([], False) if not required else (None, None)
    if (not isinstance(ids, list) or len(ids) > 100 or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 < i < 2**63 for i in ids)):
        raise BadRequest("'after' / 'after_any' must be a list of job ids (at most 100), "
                         "e.g. [12, 13]")
    ids = sorted(set(ids))
    try:
        with current_db().read() as conn:
            lifecycle.check_dependencies(conn, ids, job_id)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return ids, after_any is not None


@bp.post("/jobs")
@requires("write")
def submit():
    spec = parse_job_spec(body())
    try:
        job = current_lifecycle().submit(spec)
    except lifecycle.LimitRefused as e:
        raise BadRequest(str(e)) from None
    warnings = shared_folder_warnings(current_db(), job)
    return ({**job, "warnings": warnings} if warnings else job), 201


def _folders(job):
    """(TensorBoard folder, checkpoint folder) a job's files are looked for in, as written
    (placeholders unfilled: `tb/{run}` is never another job's)."""
    wd = job["working_dir"]
    tb = posixpath.normpath(posixpath.join(wd, job["tb_dir"])) if job.get("tb_dir") else wd
    watch = (posixpath.normpath(posixpath.join(wd, job["watch_dir"]))
             if job.get("watch_dir") else None)
    return tb, watch


def shared_folder_warnings(db, job):
    """Sentences for a new job whose TensorBoard or checkpoint folder is an unfinished
    job's too: the agent reads there only the files it can tell are this job's (agent.py
    Writers), so say how to keep them apart before anything is lost."""
    if placeholders.names([job.get("tb_dir") or "", job.get("watch_dir") or ""]) \
            & set(placeholders.JOB):
        return []
    tb, watch = _folders(job)
    out = []
    for other in jobs.unfinished_in(db, job["working_dir"], job["id"]):
        otb, owatch = _folders(other)
        same = [what for what, mine, theirs in (("TensorBoard", tb, otb),
                                                ("checkpoint", watch, owatch))
                if mine and mine == theirs]
        if same:
            where = tb if same[0] == "TensorBoard" else watch
            out.append(f"job {other['id']} ({other['name']}) uses the same "
                       f"{' and '.join(same)} folder{'s' if len(same) > 1 else ''} ({where}):"
                       " only files GPUPlane can tell apart are read for each; give each "
                       "job its own, e.g. --tb-dir tb/{run} --watch checkpoints/{run} and "
                       "the same {run} in the command")
    return out[:5]


@bp.get("/jobs")
@requires("read")
def list_jobs():
    state = query_state(STATES)
    limit = query_int("limit", 100, min=1, max=10000)
    ids = query_ids("ids")
    return {"jobs": [job_view(j, with_env=False)
                     for j in jobs.list_jobs(current_db(), state, limit, ids=ids)]}


@bp.get("/jobs/<int:job_id>")
@requires("read")
def show(job_id):
    job = with_attempts(current_db(), _job_or_404(job_id))
    if job.get("time_limit_s"):
        job["warning_signal"] = timelimit.warning_signal(
            job, current_app.config["GPUPLANE"].get("time_signal"))
    return job_view(job)


def with_attempts(db, job):
    """The job with its attempts and its current attempt's Slurm job id (docs/slurm.md),
    as `job show` and the dashboard see it."""
    job = dict(job, attempts=attempts(db, job["id"]))
    job["slurm_job_id"] = next((a["slurm_job_id"] for a in job["attempts"]
                                if a["attempt"] == job["attempt"]), None)
    return job


def attempts(db, job_id):
    """A job's attempts, one per run, for the job view (REST and the dashboard stream)."""
    return [
        {"attempt": r["attempt"], "run_id": r["id"], "state": r["state"], "node": r["node"],
         "gpu_indices": r["gpu_indices"], "exit_code": r["exit_code"],
         "slurm_job_id": r.get("slurm_job_id"),
         "failure_kind": r["failure_kind"], "started_at": r["started_at"],
         "ended_at": r["ended_at"]}
        for r in runs.for_job(db, job_id)]


@bp.post("/jobs/<int:job_id>/cancel")
@requires("write")
def cancel(job_id):
    _job_or_404(job_id)
    job, accepted = current_lifecycle().cancel(job_id)
    if not accepted:
        raise Conflict(f"job {job_id} already ended ({job['state']}); nothing to cancel")
    return job_view(job)


@bp.post("/jobs/<int:job_id>/retry")
@requires("write")
def retry(job_id):
    _job_or_404(job_id)
    data = body() if request.get_data(cache=True) else {}
    resume = field(data, "resume", bool, False)
    job, ok = current_lifecycle().retry(job_id, resume=resume)
    if not ok:
        raise Conflict(f"job {job_id} is {job['state']} and has an attempt still to come or "
                       "under way; retry runs a job again once it has ended (SUCCEEDED, "
                       "FAILED or CANCELLED): wait for it, or `gpuplane job cancel "
                       f"{job_id}` first")
    return job_view(job)


@bp.post("/jobs/<int:job_id>/checkpoints:prune")
@requires("write")
def prune_checkpoints(job_id):
    """Apply a retention policy (the body's, else the job's own) to the job's checkpoints;
    dry_run: only say what would go."""
    job = _job_or_404(job_id)
    data = body() if request.get_data(cache=True) else {}
    dry_run = field(data, "dry_run", bool, False)
    policy = {k: data[k] for k in ("keep_best", "keep_last") if k in data} or None
    try:
        policy = retention.parse_policy(policy) if policy else None
        return retention.prune(current_db(), current_lifecycle(), current_app.config.get(
            "GATEWAY"), job, policy, dry_run=dry_run)
    except retention.PolicyError as e:
        raise BadRequest(str(e)) from None


def _queued_only(job, verb):
    raise Conflict(f"job {job['id']} is {job['state']}; only a QUEUED job can be {verb}")


@bp.post("/jobs/<int:job_id>/hold")
@requires("write")
def hold(job_id):
    return _set_held(job_id, True)


@bp.post("/jobs/<int:job_id>/release")
@requires("write")
def release(job_id):
    return _set_held(job_id, False)


def _set_held(job_id, held):
    _job_or_404(job_id)
    job, ok = current_lifecycle().hold(job_id, held)
    if not ok:
        _queued_only(job, "held" if held else "released")
    return job_view(job)


@bp.patch("/jobs/<int:job_id>")
@requires("write")
def edit(job_id):
    """Change a queued job: 'priority', 'after' or 'after_any'."""
    _job_or_404(job_id)
    data = body()
    unknown = set(data) - {"priority", "after", "after_any"}
    if unknown:
        raise BadRequest(f"a queued job's {', '.join(sorted(map(repr, unknown)))} cannot be "
                         "changed; only 'priority', 'after' and 'after_any' can")
    priority = field(data, "priority", int, None, min=-1000, max=1000, nullable=True)
    depends_on, depends_any = _dependencies(data, job_id, required=True)
    job, ok = current_lifecycle().edit_queued(job_id, priority=priority,
                                              depends_on=depends_on, depends_any=depends_any)
    if not ok:
        _queued_only(job, "edited")
    return job_view(job)


@bp.get("/jobs/<int:job_id>/logs")
@requires("read")
def get_logs(job_id):
    job = _job_or_404(job_id)
    n = query_int("tail", 100, min=0, max=100_000)
    return {"job_id": job_id, "job_state": job["state"], "lines": logs.tail(current_db(), job_id, n)}


@bp.get("/jobs/<int:job_id>/logs/stream")
@requires("read")
def stream_logs(job_id):
    _job_or_404(job_id)
    last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
    if last is not None:
        try:
            last_id = int(last)
        except ValueError:
            last_id = -1
        if not 0 <= last_id < 2**63:
            raise BadRequest("Last-Event-ID must be the id of a line this stream sent")
        backlog = None
    else:
        last_id = 0
        backlog = query_int("tail", 100, min=0, max=2000)
    db, hub = current_db(), current_app.config["HUB"]
    slots = current_app.config["STREAMS"]
    slots.acquire("sse")        # 503 + Retry-After beyond the followers' share of threads
    gone = _gone_check(request.environ.get("gunicorn.socket"))
    resp = Response(_sse(db, hub, job_id, last_id, backlog, gone), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.call_on_close(lambda: slots.release("sse"))
    return resp


def _gone_check(sock):
    """Whether the follower hung up (its socket reads EOF), so its thread and its slot
    come back within a second instead of at the next keepalive write."""
    if sock is None:
        return lambda: False

    def gone():
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True
    return gone


def _sse(db, hub, job_id, last_id, backlog, gone=lambda: False):
    # The headers go out with the first chunk: without this a follower of a quiet job
    # would see no answer at all until the first keepalive, 15 s later.
    yield ": following\n\n"
    if backlog is not None:
        lines = logs.tail(db, job_id, backlog) if backlog else []
        if lines:
            last_id = lines[-1]["id"]
        elif not backlog:
            last_id = (logs.tail(db, job_id, 1) or [{"id": 0}])[0]["id"]
        yield from _events(lines)
    while not hub.closed:       # on shutdown the client reconnects with Last-Event-ID
        version = hub.version
        lines = logs.after(db, job_id, last_id)
        if lines:
            last_id = lines[-1]["id"]
            yield from _events(lines)
            continue
        job = jobs.get(db, job_id)
        if job is None or job["state"] in jobs.FINAL:
            yield from _events(logs.after(db, job_id, last_id, limit=100_000))
            yield f"event: end\ndata: {json.dumps({'state': job and job['state']})}\n\n"
            return
        quiet_since = time.monotonic()
        while hub.wait(version, 1.0) == version and not hub.closed:
            if gone():
                return
            if time.monotonic() - quiet_since >= SSE_KEEPALIVE_S:
                # Nothing new: a comment line, so a vanished client frees this thread.
                yield ": keepalive\n\n"
                quiet_since = time.monotonic()


def _events(lines):
    for line in lines:
        yield f"id: {line['id']}\ndata: {json.dumps(line)}\n\n"
