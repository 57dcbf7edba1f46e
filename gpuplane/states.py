"""The states of jobs, attempts, runs and sweeps, defined once (docs/concepts.md has the words).

A job is what is scheduled: QUEUED → DISPATCHED (a node holds its slots) → RUNNING →
SUCCEEDED, FAILED or CANCELLED; a lost attempt may put it back to QUEUED.
An attempt is one try of a job on an agent, which reports it RUNNING, then EXITED with
how it ended (docs/protocol.md); a Slurm agent reports it PENDING while Slurm holds it.
A run is one attempt's training semantics: STARTING → RUNNING → SUCCEEDED, FAILED or
CANCELLED.

Only lifecycle.py changes a state; everyone else compares against these names. SQL in
gpuplane/db/ spells them as literals, and tests/test_states.py checks that every state
spelled anywhere in the package is one of these.
"""
QUEUED = "QUEUED"
DISPATCHED = "DISPATCHED"
STARTING = "STARTING"
RUNNING = "RUNNING"
EXITED = "EXITED"
PENDING = "PENDING"         # an attempt a Slurm agent submitted and Slurm holds (docs/slurm.md)
SUCCEEDED = "SUCCEEDED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
STOPPED = "STOPPED"
DONE = "DONE"

JOB_STATES = (QUEUED, DISPATCHED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
JOB_ACTIVE = (DISPATCHED, RUNNING)            # holding slots on a node
JOB_FINAL = (SUCCEEDED, FAILED, CANCELLED)

ATTEMPT_STATES = (RUNNING, EXITED, PENDING)   # what an agent reports of an attempt

RUN_STATES = (STARTING, RUNNING, SUCCEEDED, FAILED, CANCELLED)
RUN_ACTIVE = (STARTING, RUNNING)
RUN_FINAL = (SUCCEEDED, FAILED, CANCELLED)

# A sweep (gpuplane/sweeps.py) launches trials while RUNNING; it ends STOPPED (its trials
# failed), DONE or CANCELLED.
SWEEP_STATES = (RUNNING, STOPPED, DONE, CANCELLED)
SWEEP_ACTIVE = (RUNNING,)
SWEEP_FINAL = (STOPPED, DONE, CANCELLED)



# Why the platform ended a job before its own end: the job is CANCELLED with one of these
# as its failure kind and its `stop_reason` ({"reason", "message", ...}) says the rest.
# A plain cancel by hand is failure kind CANCELLED.
EARLY_STOPPED = "EARLY_STOPPED"          # a sweep's early-stopping rule (gpuplane/pruning.py)
STOPPED_ON_EVENT = "STOPPED_ON_EVENT"    # an event the job's stop_on names (docs/events.md)
STOP_REASONS = (EARLY_STOPPED, STOPPED_ON_EVENT)

# A sweep's trial, as `sweep show` says it (gpuplane/api/sweeps.py trial_state): its
# job's state, or PENDING (not launched), RETRY (marked to run again), STOPPING (a stop
# sent, the job not ended yet), EARLY_STOPPED / STOPPED_ON_EVENT (the stop landed).
RETRY = "RETRY"
STOPPING = "STOPPING"
TRIAL_STATES = (PENDING, RETRY, QUEUED, DISPATCHED, RUNNING, STOPPING, SUCCEEDED,
                *STOP_REASONS, FAILED, CANCELLED)


def stop_label(stop):
    """A stop's words for people: "early-stopped (ASHA rung 0, step 20)", "stopped on
    LOSS_DIVERGED (step 812)"; None for no stop (or one of an unknown kind)."""
    if not isinstance(stop, dict) or stop.get("reason") not in STOP_REASONS:
        return None
    step = stop.get("step")
    at = f"step {step}" if step is not None else None
    if stop["reason"] == EARLY_STOPPED:
        rule = {"asha": "ASHA", "median": "median rule"}.get(stop.get("rule"),
                                                             stop.get("rule") or "rule")
        where = [f"{rule} rung {stop['rung']}" if stop.get("rung") is not None else rule, at]
        return "early-stopped (" + ", ".join(w for w in where if w) + ")"
    return f"stopped on {stop.get('event') or 'an event'}" + (f" ({at})" if at else "")


def end_label(job):
    """How a job ended, in one phrase: "succeeded", "failed (OOM)", "cancelled",
    "early-stopped (ASHA rung 0, step 20)"; None while it has not ended."""
    state = job.get("state")
    if state not in JOB_FINAL:
        return None
    label = stop_label(job.get("stop_reason")) if state == CANCELLED else None
    if label:
        return label
    kind = job.get("failure_kind")
    if state == FAILED and kind:
        return f"failed ({kind})"
    return state.lower()


def why_not_succeeded(job):
    """The platform's own sentence on why a job did not succeed ("working dir does not
    exist on this host: /x", "command not found: pythn", "node gpu1 lost"), or None.
    `job show`, `logs`, `explain` (explain_failure) and the dashboard say this one."""
    if job.get("state") == SUCCEEDED or (job.get("state") == CANCELLED
                                         and stop_label(job.get("stop_reason"))):
        return None         # a stop says its own why (stop_label and its sentence)
    return job.get("message") or None


ALL = tuple(dict.fromkeys(JOB_STATES + ATTEMPT_STATES + RUN_STATES + SWEEP_STATES
                         + TRIAL_STATES))
