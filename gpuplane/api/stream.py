"""One SSE stream per dashboard tab, carrying every topic the tab shows.

    GET /api/v1/stream?topics=status,job:17,logs:17@420,run:31,events@88

Topics (`name[:arg][@cursor]`):
  status          nodes with live GPU readings, the queue, running jobs (when they change)
  job:ID          the job with its attempts (when it changes)
  logs:ID[@LINE]  log lines after line id LINE (without a cursor: the last 200 lines)
  run:ID          the run and {key: last step} of its metrics (when either changes)
  events[@ID]     events after event id ID (without a cursor: the last 50);
                  `events:run=31` or `events:job=17` for one run's or job's
Each message is `data: {"topic": <topic without cursor>, "data": ...}`. The client keeps
the cursors and names them again when it reconnects, so a server restart loses nothing.

Every open stream holds a gunicorn thread: it takes one of the server's SSE slots
(gpuplane/streams.py), and the one over the cap gets a 503 with Retry-After (the
dashboard backs off and retries).
"""
import json

from flask import Blueprint, Response, current_app, request

from ..auth import current_token, requires
from ..db import events, jobs, logs, metrics, runs
from ..errors import BadRequest
from . import current_db
from .jobs import REDACTED, _gone_check, with_attempts
from .nodes import status_view

bp = Blueprint("stream", __name__, url_prefix="/api/v1")

POLL_S = 1.0          # node stats and metrics do not publish on the hub: look this often
KEEPALIVE_S = 15
MAX_TOPICS = 32
LOG_BACKLOG = 200
EVENT_BACKLOG = 50

def parse_topics(raw):
    """'status,logs:17@420' -> [(name, arg, cursor)], or BadRequest naming the bad one."""
    out = []
    for part in (raw or "").split(","):
        part = part.strip()
        if not part:
            continue
        head, _, cursor = part.partition("@")
        name, _, arg = head.partition(":")
        try:
            cur = int(cursor) if cursor else None
            if name in ("job", "logs", "run"):
                arg = int(arg)
            elif name == "events" and arg:
                what, _, value = arg.partition("=")
                if what not in ("run", "job"):
                    raise ValueError
                arg = (what, int(value))
            elif name == "status" and not arg:
                arg = None
            elif name not in ("status", "events"):
                raise ValueError
            else:
                arg = None
        except ValueError:
            raise BadRequest(f"unknown topic {part!r}; use status, job:ID, logs:ID[@LINE], "
                             "run:ID, events[@ID], events:run=ID or events:job=ID") from None
        out.append((name, arg, cur))
    if not out:
        raise BadRequest("'topics' is required, e.g. ?topics=status,events")
    if len(out) > MAX_TOPICS:
        raise BadRequest(f"{len(out)} topics; one stream carries at most {MAX_TOPICS}")
    return out


@bp.get("/stream")
@requires("read")
def stream():
    topics = parse_topics(request.args.get("topics"))
    slots = current_app.config["STREAMS"]
    slots.acquire("sse")        # 503 + Retry-After beyond the followers' share of threads
    gone = _gone_check(request.environ.get("gunicorn.socket"))
    # env values go only to write and admin tokens, as on GET /jobs/<id>
    reveal_env = current_token()["scope"] in ("admin", "write")
    resp = Response(_run(current_db(), current_app.config["HUB"], topics, gone, reveal_env,
                         current_app.config.get("SCHEDULER")),
                    mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.call_on_close(lambda: slots.release("sse"))
    return resp


def _label(name, arg):
    if name == "events" and arg:
        return f"events:{arg[0]}={arg[1]}"
    return name if arg is None else f"{name}:{arg}"


def _msg(topic, data):
    return f"data: {json.dumps({'topic': topic, 'data': data}, separators=(',', ':'))}\n\n"


def _run(db, hub, topics, gone, reveal_env=False, scheduler=None):
    yield ": open\n\n"            # headers out now, not at the first change
    state = {}                    # per topic: cursor or last fingerprint
    for name, arg, cur in topics:
        state[(name, arg)] = cur
    idle = 0.0
    while not hub.closed and not gone():
        version = hub.version
        sent = False
        for (name, arg), seen in list(state.items()):
            out, state[(name, arg)] = _poll(db, name, arg, seen, reveal_env, scheduler)
            for data in out:
                sent = True
                yield _msg(_label(name, arg), data)
        if hub.wait(version, POLL_S) == version:
            idle = 0.0 if sent else idle + POLL_S
            if idle >= KEEPALIVE_S:
                idle = 0.0
                yield ": keepalive\n\n"


def _poll(db, name, arg, seen, reveal_env=False, scheduler=None):
    """(messages to send, new state) for one topic."""
    if name == "logs":
        if seen is None:
            lines = logs.tail(db, arg, LOG_BACKLOG)
        else:
            lines = logs.after(db, arg, seen, limit=1000)
        if not lines:
            return [], seen if seen is not None else 0
        return [{"lines": lines}], lines[-1]["id"]
    if name == "events":
        run_id = arg[1] if arg and arg[0] == "run" else None
        job_id = arg[1] if arg and arg[0] == "job" else None
        if seen is None:
            found = events.list_events(db, run_id=run_id, job_id=job_id, limit=EVENT_BACKLOG)
        else:
            found = events.list_events(db, run_id=run_id, job_id=job_id, after_id=seen,
                                       limit=500)
        if not found:
            return [], seen if seen is not None else 0
        return [{"events": found}], found[-1]["id"]
    if name == "status":
        data = status_view(db, scheduler)
    elif name == "job":
        job = jobs.get(db, arg)
        data = job and with_attempts(db, job)
        if data and not reveal_env:
            data["env"] = {k: REDACTED for k in data.get("env") or {}}
    else:  # run
        data = {"run": runs.get(db, arg), "tips": metrics.tips(db, arg)}
    fingerprint = json.dumps(data, sort_keys=True, default=str)
    if fingerprint == seen:
        return [], seen
    return [data], fingerprint
