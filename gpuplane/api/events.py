"""Events: the stored list and the live stream (docs/api.md, docs/events.md).

  GET /events?run=&job=&type=&severity=&since=&after=&limit=   oldest first
  GET /events/stream  (same filters; resumes after Last-Event-ID)   text/event-stream
`type` takes several types separated by commas; `severity` is the minimum (info, warning,
critical); `since` is milliseconds since the epoch, an ISO 8601 time, or an age like 30m.
"""
import datetime
import json
import re

from flask import Blueprint, Response, current_app, request

from ..auth import requires
from ..db import events, now_ms
from ..errors import BadRequest
from .validate import query_int
from . import current_db

bp = Blueprint("events", __name__, url_prefix="/api/v1")

KEEPALIVE_S = 15
POLL_S = 1.0          # events written outside the engine (lifecycle) are seen this soon
_DIGITS = re.compile(r"^[0-9]{1,30}$")      # str.isdigit() also takes "²", int() does not
_AGE = re.compile(r"^([0-9]{1,9})\s*(s|m|h|d)$")
_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _since():
    raw = request.args.get("since")
    if not raw:
        return None
    raw = raw.strip()
    if _DIGITS.match(raw):
        v = int(raw)
        if v >= 2**63:
            raise BadRequest("'since' is out of range; send milliseconds since the epoch")
        return v
    m = _AGE.match(raw)
    if m:
        return now_ms() - int(m.group(1)) * _UNITS[m.group(2)]
    try:
        t = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"'since' must be milliseconds since the epoch, an ISO 8601 time "
                         f"(2026-11-30T14:00:00Z) or an age like 30m, 2h, 1d; got "
                         f"{raw[:40]!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return int(t.timestamp() * 1000)


def filters():
    """The filters shared by the list and the stream, checked."""
    sev = request.args.get("severity") or None
    if sev is not None and sev not in events.SEVERITY_RANK:
        raise BadRequest(f"'severity' must be one of info, warning, critical (the minimum "
                         f"to show); got {sev[:40]!r}")
    types = [t.strip() for t in (request.args.get("type") or "").split(",") if t.strip()]
    if len(types) > 50:
        raise BadRequest("'type' lists more than 50 types")
    return {"run_id": query_int("run", None, min=1), "job_id": query_int("job", None, min=1),
            "types": types or None, "min_severity": sev, "since_ms": _since()}


@bp.get("/events")
@requires("read")
def list_events():
    f = filters()
    limit = query_int("limit", 200, min=1, max=10_000)
    after = query_int("after", None, min=0)
    if after is None:       # no cursor: the latest `limit`, oldest first
        rows = events.query(current_db(), limit=limit, newest=True, **f)
    else:
        rows = events.query(current_db(), after_id=after, limit=limit, **f)
    last = rows[-1]["id"] if rows else (after if after is not None else
                                        events.last_id(current_db()))
    return {"events": rows, "last_id": last}


def _last_event_id():
    raw = request.headers.get("Last-Event-ID") or request.args.get("after")
    if raw is None or raw == "":
        return None
    raw = raw.strip()
    if not _DIGITS.match(raw) or int(raw) >= 2**63:
        raise BadRequest("Last-Event-ID (or 'after') must be the id of an event this stream "
                         "sent: an integer from 0 to 2**63-1")
    return int(raw)


@bp.get("/events/stream")
@requires("read")
def stream():
    f = filters()
    last = _last_event_id()
    db = current_db()
    if last is None:
        # a fresh follower gets the latest few for context, then what comes
        backlog = query_int("tail", 10, min=0, max=1000)
        rows = events.query(db, limit=backlog, newest=True, **f) if backlog else []
        last = rows[-1]["id"] if rows else events.last_id(db)
    else:
        rows = []
    app = current_app._get_current_object()
    slots = app.config["STREAMS"]       # a follower holds a thread: the shared budget
    slots.acquire("sse")                # 503 with Retry-After when it is spent
    resp = Response(_sse(app, db, f, last, rows), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.call_on_close(lambda: slots.release("sse"))
    return resp


def _sse(app, db, f, last, backlog):
    hub, closing = app.config["EVENTS"].hub, app.config["HUB"]
    yield ": following events\n\n"
    yield from _frames(backlog)
    quiet = 0.0
    while not closing.closed:
        version = hub.version
        rows = events.query(db, after_id=last, limit=500, **f)
        if rows:
            last = rows[-1]["id"]
            quiet = 0.0
            yield from _frames(rows)
            continue
        if hub.wait(version, POLL_S) == version:
            quiet += POLL_S
            if quiet >= KEEPALIVE_S:      # a vanished client frees its thread here
                quiet = 0.0
                yield ": keepalive\n\n"


def _frames(rows):
    for r in rows:
        yield f"id: {r['id']}\nevent: event\ndata: {json.dumps(r)}\n\n"
