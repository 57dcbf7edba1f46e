"""Stop on events: a job whose `stop_on` names an event type ends at once when the event
engine files one on its run (docs/events.md, "Stop on events").

The engine calls `notify` with the ids of the events it just stored (its listener, on
its own thread); a job still queued or running whose stop_on lists the type is cancelled
through the lifecycle with a stop reason, as an early stop is: it ends CANCELLED with
failure kind STOPPED_ON_EVENT and the event's sentence, not as a cancel by hand. A sweep's
trials stop on LOSS_NAN and LOSS_DIVERGED unless the sweep says otherwise
(gpuplane/api/sweeps.py TRIAL_STOP_ON).
"""
import logging

from . import states
from .db import events as db_events, loads

log = logging.getLogger(__name__)


class StopOnEvents:
    def __init__(self, db, lifecycle):
        self.db = db
        self.lifecycle = lifecycle

    def notify(self, ids):
        ids = [int(i) for i in ids if i is not None]
        if not ids:
            return
        rows = db_events.for_stop_on(self.db, ids)
        stopped = set()
        for r in rows:
            if r["job_id"] in stopped or r["type"] not in loads(r["stop_on"], []):
                continue
            stopped.add(r["job_id"])
            at = f" at step {r['step']}" if r["step"] is not None else ""
            reason = {"reason": states.STOPPED_ON_EVENT, "event": r["type"],
                      "event_id": r["id"], "step": r["step"],
                      "message": f"{r['type']}{at} (event {r['id']}): {r['message']}"}
            job, accepted = self.lifecycle.cancel(r["job_id"], stop_reason=reason)
            if accepted:
                log.info("job %d stopped on event %d (%s)", r["job_id"], r["id"], r["type"])
