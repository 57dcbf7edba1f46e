"""gpuplane-mcp: the GPUPlane control plane as MCP tools for coding agents.

Its own process, a thin layer over the REST API (gpuplane/client.py): it never touches the
database and starts even when the server is down (each tool then says so). stdio by
default (what a plugin launches); `--http PORT` serves streamable HTTP at /mcp.

    gpuplane-mcp                                   # stdio
    gpuplane-mcp --http 18602                      # http://127.0.0.1:18602/mcp
    GPUCTL_SERVER=http://gpu-box:8600 GPUCTL_TOKEN=... gpuplane-mcp

Every tool is one row of TOOLS (name, description, input model, output model, the client
call); build_server registers each row, docs/mcp.md lists them with their arguments. What a
tool suggests next is built in gpuplane/next_actions.py. Errors are tool errors with a
sentence that names the fix; a read-only token gets `WriteScopeError` from every control tool.
"""
import argparse
import contextvars
import dataclasses
import inspect
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuplane import next_actions as na
from gpuplane.client import ApiError, Client, ServerUnreachable, wait_for_jobs

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
WAIT_POLL_S = 1.0
WAIT_MAX_S = 1800
WAIT_EVENTS = 50             # wait_for_job returns at most the last 50 events it saw
WHOAMI_TTL_S = 30
MAX_CALLERS = 64

# The token an HTTP caller sent with its request (set per request by a middleware);
# NO_TOKEN when an HTTP caller sent none: over HTTP each caller brings its own.
_caller_token = contextvars.ContextVar("gpuplane_caller_token", default=None)
NO_TOKEN = ""
NEEDS_TOKEN = ("Unauthorized: gpuplane-mcp over HTTP needs a GPUPlane token of your own: "
               "send `Authorization: Bearer TOKEN` with each request (make one with "
               "`gpuplane token create --name NAME --scope read` or `--scope write`); it never "
               "lends its own token to a caller over HTTP")

INSTRUCTIONS = """GPUPlane runs training jobs on GPU machines. Loop: set_primary_metric ->
submit_job (one per setting) -> wait_for_jobs (one call for the whole sweep; never poll) ->
compare_runs / get_metric_table -> evaluate_checkpoint -> wait_for_jobs -> get_best_checkpoint.
A job's attempts are runs (wait_for_jobs and get_job give their run_id); list_runs shows the
trainings with their params and best evaluation. Every semantic result has next_actions:
tool calls with their arguments filled in. Paths (working_dir) are on the agent's host,
absolute."""


class ToolFailure(Exception):
    """A tool error with a sentence for the agent (becomes mcp's ToolError)."""


# -- output models -----------------------------------------------------------------------------

class NextAction(BaseModel):
    tool: str = Field(description="the MCP tool to call next")
    arguments: dict[str, Any] = Field(description="its arguments; '<...>' marks a value to fill in")
    why: str = Field(description="what it is for")


class Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class StatusOut(Out):
    nodes: list[dict[str, Any]] = Field(
        description="nodes with their GPUs and which job holds each")
    queue: list[dict[str, Any]] = Field(description="queued jobs in the order they will start")
    running: list[dict[str, Any]] = Field(description="jobs now running")
    summary: str


class JobsOut(Out):
    jobs: list[dict[str, Any]]
    count: int


class JobOut(Out):
    id: int
    name: str
    state: str = Field(description="QUEUED, DISPATCHED, RUNNING, SUCCEEDED, FAILED or CANCELLED")
    end: str | None = Field(None, description="how it ended, in words: 'succeeded', 'failed "
                            "(OOM)', 'cancelled', 'early-stopped (ASHA rung 0, step 20)' (a "
                            "sweep's rule stopped it: CANCELLED with failure_kind "
                            "EARLY_STOPPED), 'stopped on LOSS_DIVERGED (step 812)' (its "
                            "stop_on: failure_kind STOPPED_ON_EVENT)")
    run_id: int | None = Field(None, description="the run of the current attempt")
    next_actions: list[NextAction] = []


class LogsOut(Out):
    job_id: int
    job_state: str
    lines: list[dict[str, Any]] = Field(description="[{line_no, ts, text, attempt}], oldest first")


class RunsOut(Out):
    runs: list[dict[str, Any]] = Field(
        description="[{id, name, state, kind, job_id, project, experiment, params, "
                    "best_evaluation {key, value, checkpoint_id, step} (trainings), "
                    "parent_checkpoint_id (evaluations), exit_code, failure_kind, "
                    "started_at, ended_at}], newest first")
    count: int


class TableOut(Out):
    columns: list[str] = Field(description="'step', then 'RUN:KEY' for each run and metric")
    rows: list[list[float | int | str | None]] = Field(
        description="one per step: the step, then each column's value at it (the last "
                    "point at or before the step; null: none)")
    at: str
    summary: str


class RunOut(Out):
    id: int
    state: str
    job_id: int | None = None
    config: dict[str, Any] = {}


class MetricSummaryOut(Out):
    run_id: int
    keys: list[dict[str, Any]] = Field(
        description="per metric: key, role (train|eval|system|other), count, latest {step, "
                    "value}, best {step, value}, direction (min|max|null: unknown, never "
                    "judged), trend (improving|worsening|flat|unknown)")
    system_left_out: int = Field(0, description="system series not shown "
                                                "(include_system=true shows them)")


class MetricSeriesOut(Out):
    run_id: int
    key: str
    level: int | None = Field(description="bucket width in steps (1 = raw points)")
    points: list[list[float | int | str | None]] = Field(
        description="[[step, min, max, mean, last, count], ...]")
    ts: list[int | None] = Field(default_factory=list,
                                 description="ts[i]: when points[i] was logged (its first point), "
                                             "ms since the epoch")


class CheckpointsOut(Out):
    run_id: int
    checkpoints: list[dict[str, Any]]


class EventsOut(Out):
    events: list[dict[str, Any]] = Field(description="[{id, type, severity, message, run_id, "
                                                     "job_id, step, ts, data}], oldest first")


class WhoAmIOut(Out):
    name: str
    scope: str
    can_write: bool
    server: str


class WaitOut(Out):
    job_id: int
    state: str
    reached: bool = Field(description="true when the job reached what was waited for")
    timed_out: bool
    waited_s: float
    events: list[dict[str, Any]] = Field(description="the job's events that arrived while "
                                                     "waiting (the last 50)")
    events_total: int = Field(0, description="how many arrived in all")
    next_actions: list[NextAction]


class WaitedJob(Out):
    job_id: int
    name: str | None = None
    kind: str | None = Field(None, description="TRAIN or EVALUATE")
    state: str
    run_id: int | None = Field(None, description="the run of its current attempt")
    checkpoint_id: int | None = Field(None, description="an evaluation's checkpoint")
    trained_run_id: int | None = Field(None, description="the run that saved it")
    exit_code: int | None = None
    failure_kind: str | None = None
    end: str | None = Field(None, description="how it ended, in words: 'succeeded', "
                            "'early-stopped (ASHA rung 0, step 20)', 'stopped on "
                            "LOSS_DIVERGED (step 812)', ...")


class WaitManyOut(Out):
    jobs: list[WaitedJob] = Field(description="each job as it is now, in the order asked")
    reached: bool = Field(description="true when all (or, mode 'any', one) ended, or, "
                          "until 'event', an event came")
    timed_out: bool
    waited_s: float
    first_ended: int | None = Field(description="the job that ended first")
    pending: list[int] = Field(description="the jobs not ended yet")
    summary: str
    findings: list[dict[str, Any]] = Field(description="warning and critical events of these "
                                                       "jobs that arrived while waiting")
    event: dict[str, Any] | None = Field(None, description="until 'event': the critical "
                                         "event that ended the wait (the job goes on)")
    next_actions: list[NextAction]


class ControlOut(Out):
    warnings: list[str] = Field([], description="what the server warned about (a folder "
                                "another job uses too, and how to give each its own)")
    next_actions: list[NextAction] = []


class DiagnosisOut(Out):
    run_id: int
    verdict: Literal["healthy", "diverging", "not learning", "unstable", "overfitting",
                     "plateaued", "stalled", "failed", "too early to tell", "no data"]
    summary: str
    advice: str = Field("", description="what to do about the verdict, in a sentence")
    evidence: list[str]
    confidence: dict[str, Any] = Field(default_factory=dict, description="how sure: level "
                                       "(high|medium|low), points, noise, why")
    next_actions: list[NextAction]


class CompareRunsOut(Out):
    run_ids: list[int]
    winner: int | None
    significant: bool = Field(description="whether the winner's margin exceeds the runs' noise")
    summary: str
    metrics: list[dict[str, Any]]
    config_diff: dict[str, Any]
    next_actions: list[NextAction]


class CompareCheckpointsOut(Out):
    key: str | None
    direction: str
    ranked: list[dict[str, Any]]
    next_actions: list[NextAction]


class BestCheckpointOut(Out):
    checkpoint: dict[str, Any] | None = Field(
        description="the pick: checkpoint_id, run_id, step, path, value, source (evaluation "
                    "or training), and every result of its evaluation")
    runner_up: dict[str, Any] | None = None
    margin: float | None = None
    noise: float | None = Field(None, description="how much a value moves between "
                                                  "checkpoints of a run (null: too few)")
    significant: bool | None = Field(None, description="whether the margin is beyond the "
                                                       "noise (null: unknown)")
    reason: str
    next_actions: list[NextAction] = []


class SweepOut(Out):
    id: int
    name: str
    state: str = Field(description="RUNNING, STOPPED (its trials failed; stop_reason says "
                                   "why), DONE or CANCELLED")
    stop_reason: str | None = None
    best: dict[str, Any] | None = Field(None, description="the best trial so far: trial, "
                                        "job_id, run_id, value, step, params")
    best_missing: str | None = Field(None, description="why there is no best although "
                                     "trials ran (e.g. no trial logged the metric; the keys "
                                     "they did log)")
    trials_detail: list[dict[str, Any]] = Field(
        [], description="per trial: number, params, state (PENDING, QUEUED, RUNNING, "
                        "SUCCEEDED, FAILED, EARLY_STOPPED, STOPPED_ON_EVENT, ...), end (in "
                        "words), job_id, run_id, value (its best of the metric), stopped "
                        "(why, for a stop that landed)")
    trial_states: dict[str, int] = Field({}, description="how many trials are in each "
                                         "state")
    next_actions: list[NextAction] = []


class SweepsOut(Out):
    sweeps: list[dict[str, Any]]
    count: int


class ExplanationOut(Out):
    job_id: int
    kind: str = Field(description="CUDA_OOM, NCCL, MISSING_MODULE, MISSING_FILE, CUDA_ERROR, "
                                  "PERMISSION, KILLED, PYTHON_EXCEPTION, DISPATCH_FAILED, "
                                  "NODE_LOST, CANCELLED, EXIT_CODE or NOT_FAILED")
    summary: str
    lines: list[dict[str, Any]]
    suggestions: list[str]
    next_actions: list[NextAction]


# -- the tools, as plain functions of a Gpuplane (testable without the mcp package) -------------


# -- the tools' implementation: REST calls and the shaping of their answers -------------------

class Gpuplane:
    """What the tools do, as plain methods (testable without the mcp package): a REST call
    through `client`, its answer shaped, next_actions from gpuplane/next_actions.py."""

    def __init__(self, server=None, token=None, timeout=15):
        self._default = Client(server, token, timeout=timeout)
        self._timeout = timeout
        self._callers = {}      # an HTTP caller's own token -> its Client
        self._whoami = {}       # token -> (monotonic time, answer)
        self._lock = threading.Lock()

    @property
    def client(self):
        """The REST client of this call: the caller's own token when it sent one over
        HTTP (Authorization: Bearer ...), else the token gpuplane-mcp was started with."""
        token = _caller_token.get()
        if token is None:
            return self._default
        if token == NO_TOKEN:
            raise ToolFailure(NEEDS_TOKEN)
        with self._lock:
            c = self._callers.get(token)
            if c is None:
                if len(self._callers) >= MAX_CALLERS:
                    self._callers.pop(next(iter(self._callers))).close()
                c = self._callers[token] = Client(self._default.server, token,
                                                  timeout=self._timeout)
            return c

    def fail(self, tool, e):
        """The ToolFailure that tells the agent what went wrong with `tool` and what to do."""
        if isinstance(e, ServerUnreachable):
            return ToolFailure(
                f"the GPUPlane server at {self.client.server} is not reachable ({e.reason}); "
                "start it (`gpuplane up` or `gpuplane server`) or point GPUCTL_SERVER at it, "
                "then call the tool again")
        if e.status == 401:
            fix = ("send a valid one in the Authorization header" if _caller_token.get()
                   else "give gpuplane-mcp a valid token in GPUCTL_TOKEN or --token")
            return ToolFailure(f"Unauthorized: the server refused the token ({e.message}); "
                               f"{fix}")
        if e.code == "WriteScopeError":
            return ToolFailure(f"WriteScopeError: {e.message}")
        if (e.status == 404 and e.message.startswith("no such route")) or e.status == 405:
            return ToolFailure(f"this GPUPlane server cannot answer {tool} yet (its REST API "
                               "has no such route); upgrade the server")
        return ToolFailure(f"{e.code}: {_in_mcp_words(e.message)}")

    def need_write(self, tool):
        who = self.whoami()
        if not who.get("can_write"):
            # Over HTTP the caller's own token decides, not the one gpuplane-mcp started with.
            fix = ("send a token with write scope in your Authorization header"
                   if _caller_token.get() is not None else "restart gpuplane-mcp with a "
                   "write token (GPUCTL_MCP_TOKEN, GPUCTL_TOKEN or --token)")
            raise ToolFailure(
                f"WriteScopeError: {tool} changes the platform and this token "
                f"({who.get('name')!r}) has {who.get('scope')} scope; {fix} (an admin makes "
                "one with `gpuplane token create --name NAME --scope write`)")

    def whoami(self):
        """The token's whoami, cached for WHOAMI_TTL_S (every control tool asks)."""
        client = self.client
        with self._lock:
            hit = self._whoami.get(client.token)
            if hit and time.monotonic() - hit[0] < WHOAMI_TTL_S:
                return hit[1]
        who = dict(client.get_whoami(), server=client.server)
        with self._lock:
            if len(self._whoami) >= MAX_CALLERS:
                self._whoami.pop(next(iter(self._whoami)))
            self._whoami[client.token] = (time.monotonic(), who)
        return who

    # observe

    def get_status(self):
        s = self.client.get_status()
        gpus = [g for n in s.get("nodes", []) for g in n.get("gpus", [])]
        free = [g for g in gpus if not g.get("job_id")]
        nodes_up = [n for n in s.get("nodes", []) if n.get("state") == "connected"]
        summary = (f"{len(nodes_up)} of {len(s.get('nodes', []))} nodes connected, "
                   f"{len(free)} of {len(gpus)} GPUs free, {len(s.get('running', []))} "
                   f"jobs running, {len(s.get('queue', []))} queued")
        return dict(s, summary=summary)

    def get_job(self, job_id):
        job = self.client.get_job(job_id)
        return dict(job, next_actions=na.after_job(job, trained=self._trained(job)))

    @staticmethod
    def _trained(job):
        """The run whose checkpoint an EVALUATE job scores (None for a training): the
        server says it in every job it returns."""
        return job.get("checkpoint_run_id") if job.get("kind") == "EVALUATE" else None

    def list_runs(self, a):
        kind = {"train": "TRAIN", "evaluation": "EVALUATE", "all": None}[a.kind]
        rows = self.client.list_runs(project=a.project, experiment=a.experiment,
                                     job_id=a.job_id, limit=a.limit, kind=kind,
                                     best_evaluation=kind != "EVALUATE")
        keep = ("id", "name", "state", "kind", "job_id", "project", "experiment", "params",
                "best_evaluation", "parent_checkpoint_id", "exit_code", "failure_kind",
                "started_at", "ended_at")
        # the raw config and bookkeeping flags stay with get_run: a list says what differs
        return {"runs": [{k: r.get(k) for k in keep
                          if r.get(k) is not None or k == "best_evaluation" and
                          r.get("kind") == "TRAIN"} for r in rows], "count": len(rows)}

    def get_metric_summary(self, run_id, include_system=False):
        keys = self.client.list_run_metrics(run_id)
        shown = [k for k in keys if include_system or k.get("role") != "system"]
        return {"run_id": run_id, "keys": shown, "system_left_out": len(keys) - len(shown)}

    def get_metric_table(self, a):
        run_ids = list(dict.fromkeys(a.run_ids))
        summaries = {r: self.client.list_run_metrics(r) for r in run_ids}
        keys = a.keys or sorted({k["key"] for ks in summaries.values() for k in ks
                                 if k.get("role") == "eval"})
        if not keys:
            raise ToolFailure(f"runs {run_ids} log no eval metric; give keys=[...] "
                              "(get_metric_summary lists a run's metrics)")
        have = {r: {k["key"] for k in ks} for r, ks in summaries.items()}
        missing = [k for k in keys if not any(k in h for h in have.values())]
        if missing:
            raise ToolFailure(f"no run among {run_ids} logs {', '.join(missing)}; give keys "
                              "that get_metric_summary lists")
        series = {}
        for key in keys:
            for s in self.client.list_metric_series(run_ids, key, max_points=10000)["series"]:
                series[(s["run_id"], key)] = [(p[0], p[4]) for p in s.get("points") or []]
        if a.at == "checkpoints":
            steps = sorted({c["step"] for r in run_ids for c in
                            self.client.list_checkpoints(run=r)["checkpoints"]
                            if c.get("step") is not None})
        else:
            steps = sorted({st for (r, k), pts in series.items()
                            if k in keys and len(pts) <= 10000 for st, _ in pts})
        steps = steps[-a.max_rows:]
        columns = [(r, k) for r in run_ids for k in keys if k in have[r]]
        rows = []
        for step in steps:
            row = [step]
            for col in columns:
                pts = series.get(col) or []
                prior = [v for st, v in pts if st <= step]
                row.append(prior[-1] if prior else None)
            rows.append(row)
        return {"columns": ["step"] + [f"{r}:{k}" for r, k in columns], "rows": rows,
                "at": a.at, "summary": f"{len(rows)} steps x {len(columns)} run metrics "
                                       f"({', '.join(keys)})"}

    def list_checkpoints(self, run_id):
        return {"run_id": run_id,
                "checkpoints": self.client.list_checkpoints(run=run_id)["checkpoints"]}

    # wait

    def wait_for_job(self, job_id, timeout_s=300, until="end"):
        deadline = time.monotonic() + timeout_s
        start = time.monotonic()
        job = self.client.get_job(job_id)
        first_state = job["state"]
        after = self._last_event_id(job_id)
        seen, total = [], 0
        while True:
            new = self.client.list_events(job=job_id, after=after, limit=200)["events"]
            if new:
                after = new[-1]["id"]
                total += len(new)
                seen = (seen + new)[-WAIT_EVENTS:]
            state = job["state"]
            # An ended job will not change again: every mode returns at once for it.
            reached = (state in FINAL if until == "end"
                       else state not in ("QUEUED", "DISPATCHED") if until == "running"
                       else state != first_state or bool(seen) or state in FINAL)
            if reached or time.monotonic() >= deadline:
                break
            time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
            job = self.client.get_job(job_id)
        return {"job_id": job_id, "state": state, "reached": reached, "timed_out": not reached,
                "waited_s": round(time.monotonic() - start, 2), "events": seen,
                "events_total": total, "run_id": job.get("run_id"),
                "next_actions": na.after_job(job, timeout_s, until,
                                             trained=self._trained(job))}

    def wait_for_jobs(self, job_ids, mode="all", timeout_s=600, until="end"):
        start = time.monotonic()
        after = self.client.list_events(limit=1)["last_id"] or 0
        waited = wait_for_jobs(self.client, job_ids, any_=mode == "any", timeout_s=timeout_s,
                               poll_s=WAIT_POLL_S, until_event=until == "event")
        jobs, timed_out = waited
        wanted = set(job_ids)
        findings = [e for e in self.client.list_events(after=after, severity="warning",
                                                       limit=1000)["events"]
                    if e.get("job_id") in wanted][-WAIT_EVENTS:]
        rows = [{"job_id": j["id"], "name": j.get("name"), "kind": j.get("kind"),
                 "state": j["state"], "run_id": j.get("run_id"),
                 "checkpoint_id": j.get("parent_checkpoint_id"),
                 "trained_run_id": self._trained(j),
                 "exit_code": j.get("exit_code"), "failure_kind": j.get("failure_kind"),
                 "end": j.get("end"), "project": j.get("project"), "experiment": j.get("experiment") or None}
                for j in jobs]
        pending = [r["job_id"] for r in rows if r["state"] not in FINAL]
        ended = [j for j in jobs if j["state"] in FINAL]
        first = min(ended, key=lambda j: (j.get("ended_at") or 0, j["id"]))["id"] \
            if ended else None
        counts = {}
        for r in rows:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        ev = waited.event
        summary = (f"{len(rows)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items())
                   + (f"; timed out after {timeout_s} s" if timed_out else "")
                   + (f"; returned on event {ev['id']} {ev['type']} of job {ev['job_id']}"
                      if ev else ""))
        return {"jobs": rows, "reached": not timed_out, "timed_out": timed_out,
                "waited_s": round(time.monotonic() - start, 2), "first_ended": first,
                "pending": pending, "summary": summary, "findings": findings, "event": ev,
                "next_actions": (na.after_event(ev, rows) if ev else [])
                # waiting on after an event: for the end (the same event would return at once)
                + na.after_jobs(rows, pending, timeout_s, mode, "end" if ev else until)}

    def _last_event_id(self, job_id):
        evs = self.client.list_events(job=job_id, limit=1)["events"]
        return evs[-1]["id"] if evs else 0

    # control

    def submit_job(self, a):
        job = self.client.submit_job(a.command, a.working_dir, **a.model_dump(
            exclude={"command", "working_dir"}))
        return dict(job, next_actions=na.after_submit(job))

    def cancel_job(self, job_id):
        job = self.client.cancel_job(job_id)
        return dict(job, next_actions=na.after_cancel(job))

    def retry_job(self, job_id):
        job = self.client.retry_job(job_id)
        return dict(job, next_actions=na.after_retry(job))

    def evaluate_checkpoint(self, checkpoint_id, command=None):
        ckpt = self.client.get_checkpoint(checkpoint_id)
        ev = self.client.create_evaluation(checkpoint_id, command)
        return dict(ev, next_actions=na.after_evaluation(ev, ckpt["run_id"]))

    def prune_checkpoints(self, a):
        r = self.client.prune_job_checkpoints(a.job_id, a.keep_best, a.keep_last, a.dry_run)
        return dict(r, next_actions=na.after_prune(r))

    def set_primary_metric(self, key, direction, project=None, experiment=None):
        d = self.client.set_metric_definition(key, direction=direction, primary=True,
                                              project=project, experiment=experiment)
        return dict(d, next_actions=na.after_primary_metric(key, project, experiment))

    def set_project_defaults(self, a):
        fields = {k: (None if v.strip().lower() == "none" else v)
                  for k, v in (("time_limit", a.time_limit),
                               ("max_time_limit", a.max_time_limit)) if v is not None}
        if a.preemptible is not None:
            fields["preemptible"] = a.preemptible
        try:
            p = self.client.update_project(a.project, fields)
        except ApiError as e:
            if e.status != 404:
                raise
            self.client.create_project(a.project)
            p = self.client.update_project(a.project, fields)
        return dict(p, next_actions=[])

    # sweeps

    def sweep(self, data, timeout_s=600):
        return dict(data, next_actions=na.after_sweep(data, timeout_s))

    def create_sweep(self, a):
        return self.sweep(self.client.create_sweep(a.model_dump(exclude_none=True)))

    def wait_for_sweep(self, sweep_id, timeout_s=600):
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            s = self.client.get_sweep(sweep_id)
            if s["state"] != "RUNNING" or time.monotonic() >= deadline:
                break
            time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
        reached = s["state"] != "RUNNING"
        return dict(self.sweep(s, timeout_s), reached=reached, timed_out=not reached,
                    waited_s=round(time.monotonic() - start, 2))

    # semantic

    def compare_runs(self, run_ids, keys=None, key=None):
        if len(set(run_ids)) < 2:
            raise ToolFailure("compare_runs needs at least two different run ids, e.g. "
                              "run_ids=[3, 4]; list_runs shows them")
        data = self.client.compare_runs(run_ids, keys=keys, key=key)
        # The aligned overlay series (for charts) would flood an agent's context; the
        # per-metric best / final / noise say what it needs. get_metric_series has curves.
        data.pop("series", None)
        return data

    def get_best_checkpoint(self, run_id=None, experiment=None, project=None, key=None,
                            sweep_id=None):
        if run_id is None and not experiment and not project and sweep_id is None:
            raise ToolFailure("give run_id, experiment, project or sweep_id: the scope to "
                              "pick the best checkpoint from")
        data = self.client.recommend_checkpoint(run=run_id, experiment=experiment,
                                                project=project, key=key, sweep=sweep_id)
        data["reason"] = _in_mcp_words(data.get("reason") or "")
        data.setdefault("next_actions", [])
        return data


# The server's sentences name CLI commands; an agent here has the tools. Each known
# command becomes the tool (and arguments) that does the same.
_CLI_TO_TOOL = [
    (r"list (?:them|runs|jobs) with `gpuplane (run|job) list`",
     lambda m: f"list_{m[1]}s lists them"),
    (r"`gpuplane run list`", "list_runs"), (r"`gpuplane job list`", "list_jobs"),
    (r"`gpuplane status`", "get_status"),
    (r"`gpuplane job cancel (\d+)`", lambda m: f"cancel_job with job_id={m[1]}"),
    (r"(?:list them with )?`gpuplane (?:project|exp) list[^`]*`",
     "list_runs (each run names its project and experiment)"),
    (r"\(?create it with `gpuplane (?:project|exp) create[^`]*`\)?",
     "(set_primary_metric with project and experiment creates it, and so does submit_job)"),
    (r"`gpuplane ckpt (?:list|show ID)`", "list_checkpoints with a run_id"),
    (r"`gpuplane metric list`", "get_best_checkpoint (its metric says which is primary)"),
    (r"`gpuplane metric set KEY --direction min\|max --primary`",
     "set_primary_metric with project and experiment"),
    (r"`gpuplane ckpt evaluate (\d+) -- python eval.py`",
     lambda m: f"evaluate_checkpoint with checkpoint_id={m[1]} and command=[...]"),
    (r"`gpuplane sweep create \.\.\. --eval-command '([^']*)'`",
     lambda m: f"create_sweep with eval_command='{m[1]}'"),
    (r"\(`--eval-command '([^']*)'`\)", lambda m: f"(submit_job's eval_command='{m[1]}')"),
    (r"--eval-command", "eval_command"),
    (r"the CLI's -d \"\$PWD/\.\.\.\" gives one",
     "give the project's directory from / (e.g. '/home/me/project')"),
]


def _in_mcp_words(message):
    for pattern, repl in _CLI_TO_TOOL:
        message = re.sub(pattern, repl, message)
    return message


# -- the tool table ----------------------------------------------------------------------------

OBSERVE, WAIT, CONTROL, SEMANTIC = "observe", "wait", "control", "semantic"

RunId = Annotated[int, Field(description="a run's id (list_runs, or get_job's run_id)", ge=1)]
JobId = Annotated[int, Field(description="a job's id (list_jobs, or submit_job's answer)", ge=1)]
Limit = Annotated[int, Field(description="at most this many, newest first", ge=1, le=1000)]
STATES = Literal["QUEUED", "DISPATCHED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]


class In(BaseModel):
    """A tool's arguments."""
    model_config = ConfigDict(extra="forbid")


class NoArgs(In):
    pass


class JobArg(In):
    job_id: JobId


class RunArg(In):
    run_id: RunId


class ListJobsIn(In):
    state: Annotated[STATES | None, Field(description="only jobs in this state")] = None
    limit: Limit = 50


class LogsIn(In):
    job_id: JobId
    tail: Annotated[int, Field(description="how many of the last lines", ge=1, le=2000)] = 100


class ListRunsIn(In):
    project: Annotated[str | None, Field(description="only runs of this project")] = None
    experiment: Annotated[str | None, Field(description="only runs of this experiment")] = None
    job_id: Annotated[int | None, Field(description="only the runs (attempts) of this job")] = None
    kind: Annotated[Literal["train", "evaluation", "all"], Field(
        description="'train': the trainings, each with its best evaluation; 'evaluation': "
                    "the runs of evaluate_checkpoint jobs; 'all'")] = "train"
    limit: Limit = 50


class SummaryIn(In):
    run_id: RunId
    include_system: Annotated[bool, Field(description="also the system series (GPU "
                                                      "utilisation, memory, ...)")] = False


class TableIn(In):
    run_ids: Annotated[list[int], Field(description="the runs, e.g. a sweep's", min_length=1,
                                        max_length=20)]
    keys: Annotated[list[str] | None, Field(
        description="the metrics (default: the runs' eval metrics)")] = None
    at: Annotated[Literal["eval", "checkpoints"], Field(
        description="'eval': one row per step where an eval metric was logged; "
                    "'checkpoints': one row per step where a checkpoint was saved")] = "eval"
    max_rows: Annotated[int, Field(description="at most this many rows (the last ones)",
                                   ge=1, le=500)] = 100


class SeriesIn(In):
    run_id: RunId
    key: Annotated[str, Field(description="the metric, e.g. 'train/loss' "
                                          "(get_metric_summary lists them)")]
    max_points: Annotated[int, Field(description="at most this many buckets", ge=2,
                                     le=2000)] = 200
    from_step: Annotated[int | None, Field(description="first step", ge=0)] = None
    to_step: Annotated[int | None, Field(description="last step", ge=0)] = None


class EventsIn(In):
    run_id: Annotated[int | None, Field(description="only events of this run")] = None
    job_id: Annotated[int | None, Field(description="only events of this job")] = None
    type: Annotated[str | None, Field(description="only these types, comma-separated, "
                                                  "e.g. 'FAILED,LOSS_NAN'")] = None
    severity: Annotated[Literal["info", "warning", "critical"] | None,
                        Field(description="at least this severity")] = None
    since: Annotated[int | str | None, Field(
        description="only events after this time: ms since the epoch, an ISO 8601 time "
                    "or an age like '30m', '2h'")] = None
    after: Annotated[int | None, Field(description="only events after this event id "
                                                   "(the last one you saw)", ge=0)] = None
    limit: Annotated[int, Field(description="at most this many, newest kept", ge=1,
                                le=1000)] = 100


class WaitIn(In):
    job_id: JobId
    timeout_s: Annotated[int, Field(description="give up after this many seconds", ge=1,
                                    le=WAIT_MAX_S)] = 300
    until: Annotated[Literal["end", "running", "change"],
                     Field(description="'end': the job finished, failed or was cancelled; "
                                       "'running': it started; 'change': any state change "
                                       "or new event (an ended job returns at once)")] = "end"


class WaitManyIn(In):
    job_ids: Annotated[list[int], Field(description="the jobs to wait for, e.g. a sweep's "
                                                    "or its evaluations", min_length=1,
                                        max_length=100)]
    mode: Annotated[Literal["all", "any"],
                    Field(description="'all': return when every job has ended; 'any': when "
                                      "the first one ends")] = "all"
    timeout_s: Annotated[int, Field(description="give up after this many seconds", ge=1,
                                    le=WAIT_MAX_S)] = 600
    until: Annotated[Literal["end", "event"], Field(
        description="'end': as mode says; 'event': also return on the first critical event "
                    "(LOSS_NAN, LOSS_DIVERGED, OOM, STALLED, ...) filed on one of the jobs, "
                    "in `event`, so a broken run can be cancelled at once")] = "end"


class SubmitIn(In):
    command: Annotated[list[str] | str, Field(
        description="argv list, e.g. ['python', 'train.py', '--lr', '0.01'], or one shell "
                    "string")]
    working_dir: Annotated[str, Field(description="absolute directory on the agent's host "
                                                  "to run in")]
    name: Annotated[str | None, Field(description="a short name for the job")] = None
    gpus: Annotated[int | None, Field(description="GPUs on one node (default 1)", ge=0,
                                      le=64)] = None
    cpu_only: Annotated[bool | None, Field(description="needs no GPU")] = None
    priority: Annotated[int | None, Field(description="higher starts first", ge=-1000,
                                          le=1000)] = None
    max_attempts: Annotated[int | None, Field(description="retries for node loss etc.", ge=1,
                                              le=100)] = None
    env: Annotated[dict[str, str] | None, Field(description="extra environment")] = None
    project: Annotated[str | None, Field(description="project to file the run under")] = None
    experiment: Annotated[str | None, Field(description="experiment within the project")] = None
    tb_dir: Annotated[str | None, Field(
        description="TensorBoard log dir to tail (relative to working_dir); give each job "
                    "its own, e.g. 'tb/{run}' with the same in the command ({job}, "
                    "{attempt}, {run} are filled at start)")] = None
    watch_dir: Annotated[str | None, Field(
        description="checkpoint dir to watch (relative to working_dir), e.g. "
                    "'checkpoints/{run}' with the same in the command")] = None
    eval_command: Annotated[list[str] | str | None, Field(
        description="how to evaluate one of its checkpoints, e.g. ['python', 'eval.py']; "
                    "evaluate_checkpoint runs it with GPUCTL_CHECKPOINT_PATH set")] = None
    time_limit: Annotated[str | None, Field(
        description="time limit, e.g. '2h', '90m', '1:30:00': a warning signal (SIGUSR1) "
                    "comes before it, then the job is stopped and ends FAILED with kind "
                    "TIMEOUT; a limited job can start early by backfill (default: the "
                    "project's)")] = None
    preemptible: Annotated[bool | None, Field(
        description="a job of higher priority may stop it and queue it again to resume "
                    "from its last checkpoint (default: the project's, else false)")] = None
    stop_on: Annotated[list[str] | None, Field(
        description="end the job at once when one of these events is filed on its run, "
                    "e.g. ['LOSS_NAN', 'LOSS_DIVERGED'] (it ends CANCELLED with failure "
                    "kind STOPPED_ON_EVENT); default none")] = None


class EvaluateIn(In):
    checkpoint_id: Annotated[int, Field(description="the checkpoint (list_checkpoints)", ge=1)]
    command: Annotated[list[str] | None, Field(
        description="evaluation command; default: the training job's eval command")] = None


class PinIn(In):
    checkpoint_id: Annotated[int, Field(description="the checkpoint (list_checkpoints)", ge=1)]
    pinned: Annotated[bool, Field(description="true pins it (retention always keeps it), "
                                              "false unpins")] = True


class PruneIn(In):
    job_id: JobId
    keep_best: Annotated[int | None, Field(
        description="keep the best K by the metric that decides (default: the job's "
                    "policy; given alone, keep_last is 1)", ge=0, le=10_000)] = None
    keep_last: Annotated[int | None, Field(
        description="keep the last L of each run (default: the job's policy; given "
                    "alone, keep_best is 1)",
        ge=0, le=10_000)] = None
    dry_run: Annotated[bool, Field(
        description="true (the default) only says what would be deleted; false deletes "
                    "the files from disk")] = True


class PruneOut(ControlOut):
    keep: list[dict[str, Any]] = Field(description="[{checkpoint_id, path, step, reason}]")
    delete: list[dict[str, Any]] = Field(
        description="[{checkpoint_id, run_id, path, step, size_bytes, node}]: deleted, or "
                    "with dry_run what would be")
    bytes: int = Field(description="the bytes those files hold")
    dry_run: bool


class PrimaryMetricIn(In):
    key: Annotated[str, Field(description="the metric that decides, e.g. 'val/acc'")]
    direction: Annotated[Literal["min", "max"], Field(description="whether lower or higher "
                                                                  "is better")]
    project: Annotated[str | None, Field(description="scope: this project only")] = None
    experiment: Annotated[str | None, Field(description="scope: this experiment only "
                                                        "(with project)")] = None


class ProjectDefaultsIn(In):
    project: Annotated[str, Field(description="the project")]
    time_limit: Annotated[str | None, Field(
        description="its jobs' time limit when they give none, e.g. '4h'; 'none' clears "
                    "it")] = None
    max_time_limit: Annotated[str | None, Field(
        description="the longest limit its jobs may ask for, e.g. '24h'; 'none' clears "
                    "it")] = None
    preemptible: Annotated[bool | None, Field(
        description="its jobs are preemptible unless they say not")] = None


class DiagnoseIn(In):
    run_id: RunId
    key: Annotated[str | None, Field(description="the metric to judge (default: the "
                                                 "primary one)")] = None


class CompareRunsIn(In):
    run_ids: Annotated[list[int], Field(description="two or more run ids", min_length=2,
                                        max_length=20)]
    keys: Annotated[list[str] | None, Field(description="only these metrics")] = None
    key: Annotated[str | None, Field(description="the metric that names the winner "
                                                 "(default: the primary one)")] = None


class CompareCheckpointsIn(In):
    run_ids: Annotated[list[int], Field(description="the runs whose checkpoints to rank",
                                        min_length=1, max_length=20)]
    key: Annotated[str | None, Field(description="rank by this metric (default: the "
                                                 "primary one)")] = None


SweepId = Annotated[int, Field(description="a sweep's id (list_sweeps, or create_sweep's "
                                           "answer)", ge=1)]


class SweepArg(In):
    sweep_id: SweepId


class ListSweepsIn(In):
    state: Annotated[Literal["RUNNING", "STOPPED", "DONE", "CANCELLED"] | None,
                     Field(description="only sweeps in this state")] = None
    limit: Limit = 50


class WaitSweepIn(In):
    sweep_id: SweepId
    timeout_s: Annotated[int, Field(description="give up after this many seconds", ge=1,
                                    le=WAIT_MAX_S)] = 600


class CreateSweepIn(In):
    command: Annotated[list[str] | str, Field(
        description="the template: {name} placeholders for the parameters (and {trial}), "
                    "e.g. 'python train.py --lr {lr} --bs {bs} --out ckpt-{trial}'")]
    working_dir: Annotated[str, Field(description="absolute directory on the agent's host "
                                                  "to run every trial in")]
    parameters: Annotated[dict[str, Any], Field(
        description="name -> a grid list ([16, 32]) or a random draw ({'type': "
                    "'log_uniform'|'uniform'|'int_uniform', 'low': .., 'high': ..} or "
                    "{'type': 'choice', 'values': [..]})")]
    name: Annotated[str | None, Field(description="a short name for the sweep")] = None
    trials: Annotated[int | None, Field(description="how many trials (required with random "
                                                    "draws; default: the grid's size)",
                                        ge=1, le=1000)] = None
    seed: Annotated[int | None, Field(description="seed of the random draws")] = None
    sampler: Annotated[Literal["tpe", "cmaes", "qmc", "random", "grid"] | None, Field(
        description="ask Optuna's sampler for each trial's parameters as it launches, "
                    "learning from the trials before (needs the optuna extra on the "
                    "server); default: parameters drawn at create")] = None
    parallel: Annotated[int | None, Field(description="trials at once (default 1)", ge=1,
                                          le=256)] = None
    metric: Annotated[str | None, Field(description="the metric that decides (default: the "
                                                    "experiment's primary metric)")] = None
    direction: Annotated[Literal["min", "max"] | None,
                         Field(description="whether lower or higher is better")] = None
    early_stopping: Annotated[dict[str, Any] | None, Field(
        description="{'rule': 'asha', 'min_steps': 50, 'eta': 3} or {'rule': 'median', "
                    "'warmup_steps': 100, 'min_trials': 3}; with a sampler also Optuna's "
                    "{'rule': 'optuna-median'} or {'rule': 'hyperband'}")] = None
    gpus: Annotated[int | None, Field(description="GPUs per trial (default 1)", ge=0,
                                      le=64)] = None
    cpu_only: Annotated[bool | None, Field(description="trials need no GPU")] = None
    priority: Annotated[int | None, Field(description="higher starts first", ge=-1000,
                                          le=1000)] = None
    max_attempts: Annotated[int | None, Field(description="attempts per trial (default 1)",
                                              ge=1, le=100)] = None
    env: Annotated[dict[str, str] | None, Field(description="extra environment")] = None
    project: Annotated[str | None, Field(description="project to file the runs under")] = None
    experiment: Annotated[str | None, Field(description="experiment of the trials")] = None
    tb_dir: Annotated[str | None, Field(
        description="each trial's TensorBoard dir (relative to working_dir), e.g. "
                    "'tb/{trial}' with the same in the command: trials in one folder "
                    "otherwise cannot be told apart")] = None
    watch_dir: Annotated[str | None, Field(
        description="each trial's checkpoint dir (relative to working_dir), e.g. "
                    "'checkpoints/{trial}' with the same in the command")] = None
    eval_command: Annotated[list[str] | str | None, Field(
        description="how to evaluate one trial's checkpoint, e.g. ['python', 'eval.py'] "
                    "(run with GPUCTL_CHECKPOINT_PATH set)")] = None
    time_limit: Annotated[str | None, Field(
        description="each trial's time limit, e.g. '30m' (default: the project's)")] = None
    preemptible: Annotated[bool | None, Field(
        description="trials may be stopped for jobs of higher priority and resume from "
                    "their last checkpoint (default true)")] = None
    stop_on: Annotated[list[str] | None, Field(
        description="end a trial at once on these events (default ['LOSS_NAN', "
                    "'LOSS_DIVERGED']; [] for none)")] = None


class BestCheckpointIn(In):
    run_id: Annotated[int | None, Field(description="pick within this run")] = None
    sweep_id: Annotated[int | None, Field(description="pick across all trials of this "
                                                      "sweep")] = None
    experiment: Annotated[str | None, Field(description="pick within this experiment")] = None
    project: Annotated[str | None, Field(description="pick within this project")] = None
    key: Annotated[str | None, Field(description="rank by this metric (default: the "
                                                 "primary one)")] = None


@dataclasses.dataclass(frozen=True)
class Tool:
    """One MCP tool: its name, group, description, input and output models, and `call`,
    which makes the client call (through gp.client, or a Gpuplane method that shapes the
    answer) with the validated arguments. build_server registers every row of TOOLS."""
    name: str
    group: str
    description: str
    input: type[In]
    output: type[BaseModel]
    call: Callable[["Gpuplane", Any], Any]

    @property
    def writes(self):
        return self.group == CONTROL


TOOLS = [
    # observe
    Tool("get_status", OBSERVE,
         "Nodes, their GPUs (which job holds each slot, utilisation, memory), running jobs "
         "and the queue. Start here to see whether a GPU is free before submitting.",
         NoArgs, StatusOut, lambda gp, a: gp.get_status()),
    Tool("list_jobs", OBSERVE, "Jobs, newest first, with state, node, GPUs and current run_id.",
         ListJobsIn, JobsOut,
         lambda gp, a: _counted("jobs", gp.client.list_jobs(state=a.state, limit=a.limit))),
    Tool("get_job", OBSERVE,
         "One job: state, command, working dir, failure kind and exit code, and its attempts "
         "(each attempt is a run, with its run_id).",
         JobArg, JobOut, lambda gp, a: gp.get_job(a.job_id)),
    Tool("get_job_logs", OBSERVE,
         "The last lines a job printed (the server keeps the last 2000 per job).",
         LogsIn, LogsOut,
         lambda gp, a: dict(gp.client.get_job_logs(a.job_id, tail=a.tail), job_id=a.job_id)),
    Tool("list_runs", OBSERVE,
         "Runs (one per job attempt, or registered by the SDK), newest first: the trainings "
         "by default, each with its params (hyperparameters from its command line and "
         "config, paths and bookkeeping flags left out) and its best evaluation; "
         "kind='evaluation' lists the runs of evaluations instead.",
         ListRunsIn, RunsOut, lambda gp, a: gp.list_runs(a)),
    Tool("get_run", OBSERVE,
         "One run: state, kind (TRAIN or EVALUATE, with the checkpoint it evaluated), job, "
         "node, GPUs, params, bookkeeping flags, config, exit code, failure kind, times.",
         RunArg, RunOut, lambda gp, a: gp.client.get_run(a.run_id)),
    Tool("get_metric_summary", OBSERVE,
         "Per metric of a run: its role, latest value, best value and its step (by the "
         "metric's direction), trend and point count; system series (GPU utilisation, ...) "
         "only with include_system. Cheap whatever the run's length.",
         SummaryIn, MetricSummaryOut,
         lambda gp, a: gp.get_metric_summary(a.run_id, a.include_system)),
    Tool("get_metric_table", OBSERVE,
         "Several runs' metrics side by side, one row per eval step (or per checkpoint "
         "step): the table to read a sweep epoch by epoch without pulling curves.",
         TableIn, TableOut, lambda gp, a: gp.get_metric_table(a)),
    Tool("get_metric_series", OBSERVE,
         "A metric's curve downsampled to at most max_points buckets of "
         "[step, min, max, mean, last, count]; non-finite values come as \"NaN\"/\"Infinity\"; "
         "ts[i] is when bucket i was logged (ms since the epoch).",
         SeriesIn, MetricSeriesOut,
         lambda gp, a: gp.client.get_run_metric(a.run_id, a.key, max_points=a.max_points,
                                                from_step=a.from_step, to_step=a.to_step)),
    Tool("list_checkpoints", OBSERVE,
         "The checkpoints a run saved (path, step, size) and their evaluations.",
         RunArg, CheckpointsOut, lambda gp, a: gp.list_checkpoints(a.run_id)),
    Tool("list_events", OBSERVE,
         "Events, oldest first: lifecycle (QUEUED, DISPATCHED, STARTED, SUCCEEDED, FAILED, "
         "CANCELLED, RETRIED, NODE_UP, NODE_DOWN) and rule findings (LOSS_NAN, OOM, "
         "LOSS_SPIKE, OVERFITTING_SUSPECTED, GPU_UNDERUTILIZED, STALLED, DISK_LOW), each with "
         "a severity, a message and its evidence.",
         EventsIn, EventsOut,
         lambda gp, a: gp.client.list_events(run=a.run_id, job=a.job_id, type=a.type,
                                             severity=a.severity, since=a.since,
                                             after=a.after, limit=a.limit)),
    Tool("whoami", OBSERVE,
         "The token this MCP server uses: its name, scope and whether it can write (submit, "
         "cancel, retry, evaluate, set metrics), and the server's URL.",
         NoArgs, WhoAmIOut, lambda gp, a: gp.whoami()),
    # wait
    Tool("wait_for_job", WAIT,
         "Block until a job ends (or starts, or anything happens to it), or the timeout. Use "
         "this instead of polling get_job; it returns the events that arrived meanwhile and "
         "what to do next.",
         WaitIn, WaitOut, lambda gp, a: gp.wait_for_job(a.job_id, a.timeout_s, a.until)),
    Tool("wait_for_jobs", WAIT,
         "Block until several jobs have all ended (mode 'all') or the first of them has "
         "('any'), or the timeout: one call for a whole sweep or a batch of evaluations. "
         "Returns each job's state and run_id, the warnings and critical findings that "
         "arrived meanwhile, and what to do next (compare the runs, rank the checkpoints).",
         WaitManyIn, WaitManyOut,
         lambda gp, a: gp.wait_for_jobs(a.job_ids, a.mode, a.timeout_s, a.until)),
    # control
    Tool("submit_job", CONTROL,
         "Queue a training job (needs a write token). Returns the job; then call "
         "wait_for_job with its id.",
         SubmitIn, ControlOut, lambda gp, a: gp.submit_job(a)),
    Tool("cancel_job", CONTROL,
         "Cancel a queued or running job: SIGTERM to its process group, SIGKILL after 5 s "
         "(needs a write token).",
         JobArg, ControlOut, lambda gp, a: gp.cancel_job(a.job_id)),
    Tool("retry_job", CONTROL,
         "Put a FAILED or CANCELLED job back in the queue as a new attempt (a new run; needs "
         "a write token).",
         JobArg, ControlOut, lambda gp, a: gp.retry_job(a.job_id)),
    Tool("evaluate_checkpoint", CONTROL,
         "Queue an EVALUATE job for a checkpoint; its results attach to the checkpoint and "
         "then drive get_best_checkpoint (needs a write token).",
         EvaluateIn, ControlOut, lambda gp, a: gp.evaluate_checkpoint(a.checkpoint_id,
                                                                      a.command)),
    Tool("pin_checkpoint", CONTROL,
         "Pin a checkpoint so that retention never deletes it (pinned=false unpins; needs a "
         "write token).",
         PinIn, ControlOut,
         lambda gp, a: gp.client.pin_checkpoint(a.checkpoint_id, a.pinned)),
    Tool("prune_checkpoints", CONTROL,
         "Apply a retention policy to a job's checkpoints: keep the best K by the "
         "metric that decides (a sweep's trial: the sweep's best), the last L of each run, "
         "every evaluated or pinned one. By default a dry run that lists what would go, "
         "with the reason each kept one stays; dry_run=false deletes the files (needs a "
         "write token).",
         PruneIn, PruneOut, lambda gp, a: gp.prune_checkpoints(a)),
    Tool("set_primary_metric", CONTROL,
         "Make a metric the primary one (global, project or experiment scope): checkpoint "
         "recommendations and comparisons rank by it (needs a write token).",
         PrimaryMetricIn, ControlOut,
         lambda gp, a: gp.set_primary_metric(a.key, a.direction, a.project, a.experiment)),
    Tool("set_project_defaults", CONTROL,
         "Set a project's scheduling defaults: the time limit of its jobs that give none, "
         "the longest they may ask for, whether they are preemptible (needs a write "
         "token).",
         ProjectDefaultsIn, ControlOut, lambda gp, a: gp.set_project_defaults(a)),
    # semantic
    Tool("diagnose_run", SEMANTIC,
         "Judge a run: healthy, diverging, not learning, unstable, overfitting, plateaued, "
         "stalled, failed, too early to tell or no data, with the evidence, how sure it is and "
         "next_actions (tool calls to make next).",
         DiagnoseIn, DiagnosisOut,
         lambda gp, a: gp.client.get_run_diagnosis(a.run_id, key=a.key)),
    Tool("compare_runs", SEMANTIC,
         "Runs side by side: per metric best, final and step of best, the winner by the "
         "metric's direction, whether the margin exceeds the runs' own noise, and the config "
         "keys that differ.",
         CompareRunsIn, CompareRunsOut, lambda gp, a: gp.compare_runs(a.run_ids, a.keys, a.key)),
    Tool("compare_checkpoints", SEMANTIC,
         "The checkpoints of one or more runs ranked: evaluated values first, then the "
         "training value at the checkpoint's step.",
         CompareCheckpointsIn, CompareCheckpointsOut,
         lambda gp, a: gp.client.compare_checkpoints(a.run_ids, key=a.key)),
    Tool("get_best_checkpoint", SEMANTIC,
         "The checkpoint to keep, with the reason, the runner-up and the margin.",
         BestCheckpointIn, BestCheckpointOut,
         lambda gp, a: gp.get_best_checkpoint(a.run_id, a.experiment, a.project, a.key,
                                              a.sweep_id)),
    Tool("explain_failure", SEMANTIC,
         "Why a job failed: the kind (CUDA OOM, NCCL, missing module or file, killed by a "
         "signal, Python exception, ...), the relevant log lines and what to try.",
         JobArg, ExplanationOut, lambda gp, a: gp.client.get_job_explanation(a.job_id)),
    # sweeps
    Tool("list_sweeps", OBSERVE,
         "Sweeps, newest first, with their state, trial count and trials by state.",
         ListSweepsIn, SweepsOut,
         lambda gp, a: _counted("sweeps", gp.client.list_sweeps(state=a.state,
                                                                limit=a.limit)["sweeps"])),
    Tool("get_sweep", OBSERVE,
         "One sweep: its trials with parameters, state and the decisive value, the best "
         "trial so far, early stops and why, and what to do next.",
         SweepArg, SweepOut, lambda gp, a: gp.sweep(gp.client.get_sweep(a.sweep_id))),
    Tool("wait_for_sweep", WAIT,
         "Block until a sweep has ended (every trial done, or stopped) or the timeout; "
         "returns the sweep as get_sweep does. Use it instead of polling.",
         WaitSweepIn, SweepOut, lambda gp, a: gp.wait_for_sweep(a.sweep_id, a.timeout_s)),
    Tool("create_sweep", CONTROL,
         "Start a sweep: a command template run as one job per parameter set (grid lists "
         "and seeded random draws), at most `parallel` at once, with optional early "
         "stopping (median or ASHA; needs a write token). Then call wait_for_sweep.",
         CreateSweepIn, SweepOut, lambda gp, a: gp.create_sweep(a)),
    Tool("cancel_sweep", CONTROL,
         "Launch no more trials of a sweep and cancel its queued and running ones (needs a "
         "write token).",
         SweepArg, SweepOut, lambda gp, a: gp.sweep(gp.client.cancel_sweep(a.sweep_id))),
    Tool("retry_failed_sweep", CONTROL,
         "Run a sweep's failed or lost trials again with their parameters, and let it "
         "launch again if it had stopped (needs a write token).",
         SweepArg, SweepOut,
         lambda gp, a: gp.sweep(gp.client.retry_failed_sweep(a.sweep_id))),
]
TOOL_BY_NAME = {t.name: t for t in TOOLS}


def _counted(noun, rows):
    return {noun: rows, "count": len(rows)}


def run_tool(gp, tool, arguments):
    """Call one tool with its arguments (a dict): the output model, or ToolFailure."""
    try:
        args = tool.input(**arguments)
    except ValueError as e:
        raise ToolFailure(f"bad arguments for {tool.name}: {e}") from None
    try:
        if tool.writes:
            gp.need_write(tool.name)
        return tool.output.model_validate(tool.call(gp, args))
    except (ServerUnreachable, ApiError) as e:
        raise gp.fail(tool.name, e) from None


def result_of(out):
    """The tool result as the MCP specification recommends for structured output: the
    structured content, and for clients that read only text the same JSON serialised once,
    compactly, in one text block (2025-06-18, server/tools#structured-content)."""
    from mcp.types import CallToolResult, TextContent
    data = out.model_dump(mode="json")
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(
        data, separators=(",", ":"), ensure_ascii=False))], structured_content=data)


# -- the MCP server ----------------------------------------------------------------------------

def _signature(tool):
    """The tool's input model as a function signature: what the mcp package reads to build
    the input schema and validate the arguments."""
    params = []
    for name, f in tool.input.model_fields.items():
        annotation = Annotated[(f.annotation, *f.metadata, Field(description=f.description))]
        default = inspect.Parameter.empty if f.is_required() else f.default
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                        annotation=annotation, default=default))
    return inspect.Signature(params, return_annotation=tool.output)


def build_server(gp):
    """The MCPServer with every tool of TOOLS registered (imports mcp: ~1.5 s)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    async def caller_token(ctx, call_next):
        # Over HTTP a caller's calls run with the GPUPlane token it sent, and only with
        # it: one that sends none must not be lent the token gpuplane-mcp was started
        # with (by default the local admin token) by anyone who can reach the port.
        headers = getattr(getattr(ctx, "request", None), "headers", None)
        if headers is None:
            return await call_next(ctx)         # stdio: the process's own token
        auth = headers.get("authorization", "")
        own = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        mark = _caller_token.set(own or NO_TOKEN)
        try:
            return await call_next(ctx)
        finally:
            _caller_token.reset(mark)

    server = MCPServer("gpuplane", instructions=INSTRUCTIONS, middleware=[caller_token])

    def register(tool):
        def handler(**arguments):
            try:
                return result_of(run_tool(gp, tool, arguments))
            except ToolFailure as e:
                raise ToolError(str(e)) from None
        handler.__name__ = tool.name
        handler.__signature__ = _signature(tool)
        server.add_tool(handler, name=tool.name, description=tool.description,
                        structured_output=True)

    for tool in TOOLS:
        register(tool)
    return server


def _connection_options(p, default):
    p.add_argument("--server", default=default,
                   help="GPUPlane server URL (default $GPUCTL_SERVER_URL, $GPUCTL_SERVER, "
                        "else the local server.toml's, else http://127.0.0.1:8600)")
    p.add_argument("--token", default=default,
                   help="API token (default $GPUCTL_MCP_TOKEN, $GPUCTL_TOKEN, else the local "
                        "admin token)")
    p.add_argument("--host", default=default,
                   help="address to serve HTTP on (default 127.0.0.1)")


def get_parser():
    p = argparse.ArgumentParser(
        prog="gpuplane-mcp",
        description="GPUPlane as MCP tools for coding agents: stdio by default, "
                    "`serve --port N` for streamable HTTP (also installed as gpuctl-mcp).")
    _connection_options(p, None)
    p.add_argument("--http", type=int, metavar="PORT",
                   help="serve streamable HTTP on PORT (path /mcp) instead of stdio "
                        "(the same as `serve --port PORT`)")
    modes = p.add_subparsers(dest="mode", metavar="{serve,stdio}")
    # the subcommands take the same options after their name (argparse.SUPPRESS: an
    # option not given there keeps what was given before it)
    serve = modes.add_parser("serve", help="serve streamable HTTP at http://HOST:PORT/mcp")
    serve.add_argument("--port", type=int, required=True, metavar="N")
    _connection_options(serve, argparse.SUPPRESS)
    stdio = modes.add_parser("stdio", help="speak MCP on stdin/stdout (the default)")
    _connection_options(stdio, argparse.SUPPRESS)
    return p


def main(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.mode == "serve":
        if args.http and args.http != args.port:
            parser.error("give the port once: `serve --port N` or `--http N`")
        args.http = args.port
    elif args.mode == "stdio" and args.http:
        parser.error("stdio and --http exclude each other; drop one")
    args.host = args.host or "127.0.0.1"
    token = args.token or os.environ.get("GPUCTL_MCP_TOKEN") or None
    gp = Gpuplane(args.server or os.environ.get("GPUCTL_SERVER_URL") or None, token)
    server = build_server(gp)
    if args.http:
        print(f"gpuplane-mcp: serving http://{args.host}:{args.http}/mcp for "
              f"{gp.client.server}", file=sys.stderr, flush=True)
        server.run("streamable-http", host=args.host, port=args.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
