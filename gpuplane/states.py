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



def why_not_succeeded(job):
    """The platform's own sentence on why a job did not succeed ("working dir does not
    exist on this host: /x", "command not found: pythn", "node gpu1 lost"), or None.
    `job show`, `logs`, `explain` (explain_failure) and the dashboard say this one."""
    if job.get("state") == SUCCEEDED:
        return None
    return job.get("message") or None


ALL = tuple(dict.fromkeys(JOB_STATES + ATTEMPT_STATES + RUN_STATES + SWEEP_STATES))
