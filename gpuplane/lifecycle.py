"""Job, attempt, run and node state changes, and everything they set off, in one place.

Each transition runs in one transaction that writes the new state and appends exactly one
lifecycle event to the `events` table (type in TYPES, with job, run, node and attempt and
a sentence for people). After the commit, and only then, its consequences follow in a
fixed order: the hub is published (SSE followers wake), the scheduler is woken when slots
or the queue changed, agent commands go to the gateway, and every `on_event` listener gets
each event dict. A rolled-back transition sets off nothing.

This module decides which state follows which; gpuplane/db/ holds the SQL. It knows the
scheduler and the gateway only as what app.py binds: a `wake()` callable, a `waits(job)`
one (Scheduler.waits: a job just queued that a pass would only tell why it waits gets its
reason in its own transaction, and sets off no pass), and an `agents` object with
`start(job, ingest_token)` and `cancel(node, job_id, attempt)`.

A transition can also run inside a bigger transaction (the gateway applies an agent's
batch and advances its cursor atomically): pass the `Tx` of `lifecycle.transaction()` as
`t`, and the consequences wait for that transaction's commit.
"""
import contextlib
import logging

from . import states, timelimit
from .db import checkpoints, events, jobs, nodes, now_ms, projects, runs, savepoint, tokens

log = logging.getLogger(__name__)

QUEUED, DISPATCHED, STARTED = "QUEUED", "DISPATCHED", "STARTED"
SUCCEEDED, FAILED, CANCELLED, RETRIED = "SUCCEEDED", "FAILED", "CANCELLED", "RETRIED"
NODE_UP, NODE_DOWN = "NODE_UP", "NODE_DOWN"
HELD, RELEASED = "HELD", "RELEASED"
PREEMPTED = "PREEMPTED"
TYPES = (QUEUED, DISPATCHED, STARTED, SUCCEEDED, FAILED, CANCELLED, RETRIED, NODE_UP,
         NODE_DOWN, HELD, RELEASED, PREEMPTED)

# What the agent reports as a lost attempt, and the kind the job records for it.
TRANSIENT_ALIASES = {"LOST": "NODE_LOST"}


class LimitRefused(ValueError):
    """A job's time limit (or preemptible flag) its project does not allow; the message
    names the fix."""


def apply_project_defaults(conn, spec):
    """The job as its project's scheduling defaults make it (docs/scheduling.md): no
    limit of its own takes the project's default, else its maximum; a limit above the
    maximum is refused (LimitRefused); not saying whether it is preemptible takes the
    project's word. An evaluation is never preemptible: stopped, it would lose its
    result."""
    d = projects.scheduling_defaults(conn, spec["project"])
    spec = dict(spec)
    limit, most = spec.get("time_limit_s"), d["max_time_limit_s"]
    if limit is None:
        limit = d["time_limit_s"] or most
    elif most is not None and limit > most:
        raise LimitRefused(
            f"time limit {timelimit.describe(limit)} is above the maximum of project "
            f"{spec['project']!r} ({timelimit.describe(most)}); ask for at most "
            f"{timelimit.describe(most)} (--time), or raise the maximum with `gpuplane "
            f"project defaults {spec['project']} --max-time ...`")
    spec["time_limit_s"] = limit
    if spec.get("kind", "TRAIN") == "EVALUATE":
        if spec.get("preemptible"):
            raise LimitRefused("an evaluation job cannot be preemptible: stopped, it loses "
                               "the result it was computing; leave 'preemptible' out")
        spec["preemptible"] = False
    elif spec.get("preemptible") is None:
        spec["preemptible"] = bool(d["preemptible"])
    return spec


class Tx:
    """One open transaction of state changes; `conn` is free for other SQL that must
    commit together with them. What the changes set off is collected here until commit."""

    def __init__(self, conn):
        self.conn = conn
        self.events = []
        self.commands = []
        self.wake = False
        self.moved = []         # Scheduler.waits()'s checks: any true after commit wakes it
        self.publish = False

    @contextlib.contextmanager
    def savepoint(self, name="sp"):
        """Roll back this part alone on an exception (which is re-raised), and drop what
        it would have set off."""
        mark = (len(self.events), len(self.commands), self.wake, self.publish)
        try:
            with savepoint(self.conn, name):
                yield self
        except BaseException:
            del self.events[mark[0]:]
            del self.commands[mark[1]:]
            self.wake, self.publish = mark[2], mark[3]
            raise


class Lifecycle:
    def __init__(self, db, publish=None, wake=None, agents=None):
        self.db = db
        self._publish = publish
        self._wake = wake
        self._waits = None
        self.agents = agents
        self._listeners = []

    def bind(self, *, publish=None, wake=None, waits=None, agents=None):
        """Wire the consequences (app.py does this once the pieces exist)."""
        if publish is not None:
            self._publish = publish
        if wake is not None:
            self._wake = wake
        if waits is not None:
            self._waits = waits
        if agents is not None:
            self.agents = agents

    def on_event(self, callback):
        """Call `callback(event)` after commit for every lifecycle event (a dict with id,
        type, job_id, run_id, node, severity, message, data (attempt, failure_kind, ...),
        ts). A listener must be quick and must not raise; an exception is logged."""
        self._listeners.append(callback)
        return callback

    def wake_scheduler(self):
        if self._wake is not None:
            self._wake()

    # -- transactions -------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, durable=False):
        with self.db.tx(durable=durable) as conn:
            t = Tx(conn)
            yield t
        self._after(t)

    @contextlib.contextmanager
    def _tx(self, t):
        if t is not None:
            yield t
        else:
            with self.transaction() as t:
                yield t

    def _after(self, t):
        if (t.events or t.publish) and self._publish is not None:
            self._publish()
        if t.wake or any(moved() for moved in t.moved):
            self.wake_scheduler()
        for command in t.commands:
            try:
                command()
            except Exception:
                log.exception("agent command failed")
        for event in t.events:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("lifecycle listener %r failed on %s", listener,
                                  event["type"])

    def _event(self, t, type, message, *, job=None, run_id=None, node=None, attempt=None,
               severity="info", data=None, wake=True, ts=None):
        if job is not None:
            run_id = run_id if run_id is not None else job["run_id"]
            node = node if node is not None else job["node"]
            attempt = attempt if attempt is not None else job["attempt"]
        payload = dict(data or {})
        if attempt:
            payload["attempt"] = attempt
        ev = events.add(t.conn, type, message, severity=severity, run_id=run_id,
                        job_id=job["id"] if job else None, node=node, data=payload, ts=ts)
        t.events.append(ev)
        t.wake = t.wake or wake
        return ev

    # -- jobs ---------------------------------------------------------------------------

    def submit(self, spec, t=None):
        """A new job, QUEUED, with its project's defaults (apply_project_defaults, which
        may raise LimitRefused). Returns it."""
        with self._tx(t) as t:
            spec = apply_project_defaults(t.conn, spec)
            job_id = jobs.insert(t.conn, spec, now_ms())
            job = jobs.fetch(t.conn, job_id)
            waits = self._waits(job) if self._waits is not None else None
            if waits is not None:
                job["pending_reason"], moved = waits
                jobs.set_pending_reason(t.conn, job_id, job["pending_reason"])
                t.moved.append(moved)
            self._event(t, QUEUED, f"job {job_id} ({job['name']}) queued"
                        + (" held" if job["held"] else ""), job=job, wake=waits is None)
        return job

    def assign(self, job_id, node, gpu_indices, t=None):
        """Give a queued job to a node: a new attempt, its run and ingest token, and the
        start command to the agent. Returns the job, or None when it is no longer queued
        (cancelled meanwhile)."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            if job is None or job["state"] != states.QUEUED:
                return None
            attempt = job["attempt"] + 1
            run_id = runs.create(t.conn, source="job", state=states.STARTING,
                                 project=job["project"], experiment=job["experiment"],
                                 name=job["name"], job_id=job_id, attempt=attempt, node=node,
                                 gpu_indices=gpu_indices,
                                 config={"command": job["command"], **job["config"]},
                                 kind=job["kind"],
                                 parent_checkpoint_id=job.get("parent_checkpoint_id"))
            _, secret = tokens.add(t.conn, f"run {run_id}", "ingest", run_id=run_id)
            jobs.set_dispatched(t.conn, job_id, attempt, node, gpu_indices, run_id)
            job = jobs.fetch(t.conn, job_id)
            where = ("CPU slot" if job["cpu_only"] else f"GPUs {gpu_indices}" if gpu_indices
                     else f"{job['gpus']} GPUs, placed by Slurm")
            self._event(t, DISPATCHED, f"job {job_id} attempt {attempt} sent to {node} "
                        f"({where})", job=job, wake=False)
            # If this send is lost, the job stays DISPATCHED and the agent's next sync
            # brings the same start again (gateway.reconcile).
            if self.agents is not None:
                t.commands.append(lambda: self.agents.start(job, secret))
        return job

    def waiting_in_slurm(self, job_id, attempt, slurm_job_id, reason, t=None):
        """A Slurm agent submitted the attempt and Slurm holds it PENDING (`reason` is
        Slurm's). The job stays DISPATCHED, its slot held; not a transition, so no event."""
        with self._tx(t) as t:
            if slurm_job_id:
                runs.set_slurm_job_id(t.conn, job_id, attempt, slurm_job_id)
            if reason:
                jobs.set_waiting_in_slurm(t.conn, job_id, attempt,
                                          f"queued in Slurm (job {slurm_job_id}): {reason}")
            t.publish = True

    def started(self, job_id, attempt, ts=None, t=None, slurm_job_id=None, resumed_from=None):
        """The agent started the attempt (from the checkpoint `resumed_from`, one of the
        job's earlier runs', when it handed it GPUCTL_RESUME_FROM). Returns whether the job
        became RUNNING."""
        ts = ts or now_ms()
        with self._tx(t) as t:
            if slurm_job_id:
                runs.set_slurm_job_id(t.conn, job_id, attempt, slurm_job_id)
            run = runs.for_attempt(t.conn, job_id, attempt)
            if run:
                runs.mark_running(t.conn, run["id"], ts)
                if resumed_from is not None and checkpoints.of_job(t.conn, resumed_from,
                                                                   job_id):
                    runs.set_resumed_from(t.conn, run["id"], resumed_from)
            job = jobs.fetch(t.conn, job_id)
            if not job or job["attempt"] != attempt or job["state"] != states.DISPATCHED:
                return False
            jobs.set_running(t.conn, job_id, ts)
            self._event(t, STARTED, f"job {job_id} attempt {attempt} started on "
                        f"{job['node']}", job=job, wake=False, ts=ts)
        return True

    def finished(self, job_id, attempt, *, exit_code=None, failure_kind=None, message=None,
                 ts=None, t=None):
        """An attempt ended. Returns the job's new state, or None for a stale attempt.

        No failure: SUCCEEDED. OOM, EXIT_CODE, DISPATCH_FAILED, TIMEOUT: FAILED, final. CANCELLED,
        or any failure of a job whose cancel was asked for: CANCELLED. Anything else (the
        node or the shim was lost): QUEUED again while attempts remain (RETRIED), else
        FAILED."""
        ts = ts or now_ms()
        if failure_kind is None and exit_code not in (0, None):
            failure_kind = "EXIT_CODE"
        with self._tx(t) as t:
            run = runs.for_attempt(t.conn, job_id, attempt)
            if run:
                run_state = (states.SUCCEEDED if failure_kind is None else
                             states.CANCELLED if failure_kind == "CANCELLED" else
                             states.FAILED)
                # a run a stop ended says the stop (EARLY_STOPPED), as its job does
                before = jobs.fetch(t.conn, job_id)
                stop = ((before or {}).get("stop_reason") or {}).get("reason") \
                    if failure_kind == "CANCELLED" and (before or {}).get("cancel_requested") \
                    and (before or {}).get("attempt") == attempt else None
                runs.finish(t.conn, run["id"], run_state, exit_code, stop or failure_kind, ts)
                # The job's process is gone and what it wrote is in: its ingest token
                # (one per start command) writes no more.
                tokens.revoke_for_run(t.conn, run["id"])
            job = jobs.fetch(t.conn, job_id)
            if job is None or job["attempt"] != attempt or job["state"] not in jobs.ACTIVE:
                t.publish = True      # the run's state may have changed
                return None
            stop = job["stop_reason"] if job["cancel_requested"] else None
            if job["cancel_requested"] and failure_kind is not None:
                state = states.CANCELLED
                failure_kind = (stop or {}).get("reason") or "CANCELLED"
            elif failure_kind is None:
                state = states.SUCCEEDED
            elif failure_kind == "CANCELLED":
                state = states.CANCELLED
            elif failure_kind in jobs.FINAL_FAILURES:
                state = states.FAILED
            else:
                failure_kind = TRANSIENT_ALIASES.get(failure_kind, failure_kind)
                state = states.QUEUED if attempt < job["max_attempts"] else states.FAILED
            data = {"exit_code": exit_code, "failure_kind": failure_kind}
            if state == states.CANCELLED and (stop or {}).get("reason") == PREEMPTED:
                # stopped for a more urgent job: back in the queue at its place, to resume
                jobs.set_requeued_after_preemption(t.conn, job_id)
                self._event(t, RETRIED, f"job {job_id} ({job['name']}) attempt {attempt} "
                            f"stopped for job {stop['by']}; queued again at its place, to "
                            "resume from its last checkpoint", job=job,
                            data={**data, "preempted_by": stop["by"]}, ts=ts)
                return states.QUEUED
            if state == states.QUEUED:
                jobs.set_requeued(t.conn, job_id, failure_kind, exit_code, message)
                self._event(t, RETRIED, f"job {job_id} attempt {attempt} lost "
                            f"({failure_kind}); queued again as attempt {attempt + 1} of "
                            f"{job['max_attempts']}", job=job, severity="warning", data=data)
                return state
            jobs.set_ended(t.conn, job_id, state, failure_kind, exit_code, message, ts)
            late = stop if state != states.CANCELLED else None
            if late:        # it ended on its own before the stop reached it: its own end
                jobs.set_stop_reason(t.conn, job_id, None)
                stop = None
                data["stop_came_late"] = late
            if stop:
                data.update(stop)
            text = (f"job {job_id} ({job['name']}) attempt {attempt} {state.lower()}"
                    + (f": {stop['reason']}, {stop['message']}" if stop else
                       f": {failure_kind}" if failure_kind else "")
                    + (f" (it ended before its stop reached it: {late['message']})"
                       if late else "")
                    + (f" (exit {exit_code})" if exit_code not in (None, 0) else "")
                    + (f" on {job['node']}" if job["node"] else ""))
            # OOM stays easy to find: a FAILED event with failure_kind OOM, critical.
            severity = ("critical" if failure_kind == "OOM" else
                        "warning" if state == states.FAILED else "info")
            self._event(t, state, text, job=job, severity=severity, data=data, ts=ts)
        return state

    def cancel(self, job_id, t=None, stop_reason=None):
        """Returns (job, accepted). A queued job is CANCELLED at once; an active one gets
        its cancel sent to the agent and becomes CANCELLED when the agent reports its end
        (or its node is lost). An ended job: accepted only if it was already CANCELLED.
        stop_reason: why ({"reason": "EARLY_STOPPED", "message": a sentence, ...}); the
        job keeps it and its CANCELLED event carries it."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            if job is None:
                return None, False
            if job["state"] in jobs.FINAL:
                return job, job["state"] == states.CANCELLED
            if job["state"] == states.QUEUED:
                jobs.set_ended(t.conn, job_id, states.CANCELLED,
                               (stop_reason or {}).get("reason") or "CANCELLED", None, None,
                               now_ms())
                if stop_reason:
                    jobs.set_stop_reason(t.conn, job_id, stop_reason)
                job = jobs.fetch(t.conn, job_id)
                self._event(t, CANCELLED, f"job {job_id} ({job['name']}) cancelled while "
                            "queued" + (f": {stop_reason['reason']}, {stop_reason['message']}"
                                        if stop_reason else ""), job=job,
                            data={"failure_kind": "CANCELLED", **(stop_reason or {})})
                return job, True
            jobs.set_cancel_requested(t.conn, job_id, stop_reason)
            t.publish = True
            node, attempt = job["node"], job["attempt"]
            if self.agents is not None:
                t.commands.append(lambda: self.agents.cancel(node, job_id, attempt))
            job = jobs.fetch(t.conn, job_id)
        return job, True

    def preempt(self, job_id, by, t=None):
        """Stop a running preemptible job for the more urgent job `by` (the scheduler's
        choice): its cancel goes to the agent, and when it has stopped it is queued again
        at its place to resume from its last checkpoint (finished()). An event PREEMPTED
        says who took its GPUs. Returns whether the stop was sent."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            urgent = jobs.fetch(t.conn, by)
            if job is None or urgent is None or job["state"] != states.RUNNING \
                    or job["cancel_requested"] or not job["preemptible"]:
                return False
            message = (f"preempted by job {by} ({urgent['name']}, priority "
                       f"{urgent['priority']} over {job['priority']})")
            jobs.set_preempted(t.conn, job_id, by, {"reason": PREEMPTED, "by": by,
                                                     "message": message})
            self._event(t, PREEMPTED, f"job {job_id} ({job['name']}) {message}: its GPUs "
                        f"{job['gpu_indices']} on {job['node']} go to it; it resumes later",
                        job=job, severity="warning", data={"by": by}, wake=False)
            node, attempt = job["node"], job["attempt"]
            if self.agents is not None:
                # its warning signal first, the stop its lead later (a preemption's grace)
                t.commands.append(lambda: self.agents.cancel(node, job_id, attempt, warn=job))
        return True

    def retry(self, job_id, t=None, resume=False):
        """A job that ended (SUCCEEDED, FAILED or CANCELLED) goes back in the queue; its
        next attempt is a new run (resume: handed the last checkpoint of the earlier
        attempts). A queued or active job is not retried: it has an attempt to come or
        under way. Returns (job, accepted)."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            if job is None or job["state"] not in jobs.FINAL:
                return job, False
            jobs.set_queued_by_hand(t.conn, job_id, now_ms(), resume=resume)
            job = jobs.fetch(t.conn, job_id)
            self._event(t, RETRIED, f"job {job_id} ({job['name']}) queued again by hand"
                        + (", to resume from its last checkpoint" if resume else ""),
                        job=job, run_id=None, node=None, data={"resume": resume})
        return job, True

    def dependency_failed(self, job_id, message, t=None):
        """A queued job can never start: a job it runs `--after` did not succeed. FAILED
        with DEPENDENCY_FAILED, final. Returns whether it changed."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            if job is None or job["state"] != states.QUEUED:
                return False
            jobs.set_ended(t.conn, job_id, states.FAILED, "DEPENDENCY_FAILED", None, message,
                           now_ms())
            self._event(t, FAILED, f"job {job_id} ({job['name']}) failed: {message}",
                        job=job, run_id=None, node=None, severity="warning",
                        data={"failure_kind": "DEPENDENCY_FAILED"})
        return True

    def hold(self, job_id, held=True, t=None):
        """Keep a queued job from starting (or let it start again). Returns (job,
        accepted); only a QUEUED job can be held or released."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            if job is None or job["state"] != states.QUEUED:
                return job, False
            if job["held"] == held:
                return job, True
            jobs.set_held(t.conn, job_id, held)
            job = jobs.fetch(t.conn, job_id)
            self._event(t, HELD if held else RELEASED,
                        f"job {job_id} ({job['name']}) " + ("held" if held else "released"),
                        job=job, run_id=None, node=None)
        return job, True

    def edit_queued(self, job_id, *, priority=None, depends_on=None, depends_any=None,
                    t=None):
        """Change a queued job's priority or dependencies. Returns (job, accepted).
        Raises ValueError with a sentence for a dependency cycle or an unknown job."""
        with self._tx(t) as t:
            job = jobs.fetch(t.conn, job_id)
            if job is None or job["state"] != states.QUEUED:
                return job, False
            if depends_on is not None:
                check_dependencies(t.conn, depends_on, job_id)
            jobs.set_queued_fields(t.conn, job_id, priority, depends_on, depends_any)
            t.wake = t.publish = True
            job = jobs.fetch(t.conn, job_id)
        return job, True

    # -- nodes ----------------------------------------------------------------------------

    def node_up(self, hello, t=None):
        """An agent said hello. Returns the outbox cursor of its epoch."""
        node = hello["node"]
        with self._tx(t) as t:
            cursor = nodes.hello(t.conn, hello)
            self._event(t, NODE_UP, f"node {node} connected", node=node, wake=False)
        return cursor

    def node_synced(self, node, t=None):
        """The node's jobs are reconciled: its free slots may be used. Not a transition
        of a job, so no event."""
        with self._tx(t) as t:
            nodes.set_synced(t.conn, node)
            t.wake = t.publish = True

    def node_down(self, node, t=None):
        """The agent's connection closed. Its jobs keep running (the agent re-adopts
        them) until the grace period makes them lost (node_lost)."""
        with self._tx(t) as t:
            if nodes.disconnected(t.conn, node):
                self._event(t, NODE_DOWN, f"node {node} disconnected", node=node,
                            severity="warning")

    def server_started(self):
        """A new server process holds no agent connection yet, whatever the database says
        (a crash leaves nodes 'connected'): every node is down from now, so one that never
        comes back still has its jobs declared lost after the grace period. One NODE_DOWN
        event per node the database still called connected."""
        with self.transaction() as t:
            for node in nodes.all_disconnected(t.conn):
                self._event(t, NODE_DOWN, f"node {node} has not reconnected to the new "
                            "server process yet", node=node, severity="warning")

    def node_lost(self, node, grace_s):
        """The node has been gone longer than the grace period: each of its active
        attempts is finished NODE_LOST (retried while attempts remain), one transaction
        each. Returns the job ids."""
        lost = []
        for job in jobs.active(self.db, node):
            log.warning("node %s gone for more than %.0f s: job %d attempt %d lost",
                        node, grace_s, job["id"], job["attempt"])
            self.finished(job["id"], job["attempt"], failure_kind="NODE_LOST",
                          message=f"node {node} lost")
            lost.append(job["id"])
        return lost

    # -- runs of their own (SDK, import) -----------------------------------------------

    def register_run(self, *, source, project, experiment, name, config, t=None):
        """A run the SDK (or an import) registers itself: RUNNING from the start."""
        with self._tx(t) as t:
            run_id = runs.create(t.conn, source=source, state=states.RUNNING, project=project,
                                 experiment=experiment, name=name, config=config)
            self._event(t, STARTED, f"run {run_id} ({name or source}) started",
                        run_id=run_id, wake=False)
        return run_id

    def finish_run(self, run_id, status, t=None):
        """A run that is not a job's attempt ends (a job's runs end with their attempt)."""
        with self._tx(t) as t:
            if runs.finish(t.conn, run_id, status):
                self._event(t, status, f"run {run_id} {status.lower()}", run_id=run_id,
                            wake=False, severity="warning" if status == states.FAILED else "info")


def check_dependencies(conn, depends_on, job_id=None):
    """Refuse unknown jobs and cycles (ValueError with a sentence naming them)."""
    for dep in depends_on:
        if dep == job_id:
            raise ValueError(f"job {job_id} cannot run after itself")
        if jobs.fetch(conn, dep) is None:
            raise ValueError(f"job {dep} does not exist; --after takes ids from "
                             "`gpuplane job list`")
    if job_id is None:
        return      # a new job: nothing can depend on it yet
    graph = jobs.dependency_map(conn)
    graph[job_id] = list(depends_on)
    seen, stack = set(), list(depends_on)
    while stack:
        current = stack.pop()
        if current == job_id:
            raise ValueError(f"that makes a cycle: job {job_id} would wait for itself "
                             "through its dependencies")
        if current not in seen:
            seen.add(current)
            stack.extend(graph.get(current, []))
