"""gpuplane-mcp: the GPUPlane control plane as MCP tools for coding agents.

Its own process, a thin layer over the REST API (gpuplane/client.py): it never touches the
database and starts even when the server is down (each tool then says so). stdio by
default (what a plugin launches); `--http PORT` serves streamable HTTP at /mcp.

    gpuplane-mcp                                   # stdio
    gpuplane-mcp --http 18602                      # http://127.0.0.1:18602/mcp
    GPUCTL_SERVER=http://gpu-box:8600 GPUCTL_TOKEN=... gpuplane-mcp

Tools (docs/mcp.md lists every one with its arguments): 11 observe, 5 control, 5 semantic
and wait_for_job. Errors are tool errors with a sentence that names the fix; a read-only
token gets `WriteScopeError` from every control tool.
"""
import argparse
import contextvars
import functools
import inspect
import os
import sys
import threading
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuplane.client import ApiError, Client, ServerUnreachable

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
WAIT_POLL_S = 1.0
WAIT_MAX_S = 1800
WAIT_EVENTS = 50             # wait_for_job returns at most the last 50 events it saw
WHOAMI_TTL_S = 30
MAX_CALLERS = 64

# The token an HTTP caller sent with its request (set per request by a middleware).
_caller_token = contextvars.ContextVar("gpuplane_caller_token", default=None)

INSTRUCTIONS = """GPUPlane runs training jobs on GPU machines. Loop: submit_job -> wait_for_job
(returns when the job ends or an event arrives; never poll in a loop) -> diagnose_run ->
compare_runs -> evaluate_checkpoint -> get_best_checkpoint. A job's attempts are runs
(get_job lists them with their run_id). Every semantic result has next_actions: tool calls
with arguments to make next. Paths (working_dir) are on the agent's host, absolute."""


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
    run_id: int | None = Field(None, description="the run of the current attempt")
    next_actions: list[NextAction] = []


class LogsOut(Out):
    job_id: int
    job_state: str
    lines: list[dict[str, Any]] = Field(description="[{line_no, ts, text, attempt}], oldest first")


class RunsOut(Out):
    runs: list[dict[str, Any]]
    count: int


class RunOut(Out):
    id: int
    state: str
    job_id: int | None = None
    config: dict[str, Any] = {}


class MetricSummaryOut(Out):
    run_id: int
    keys: list[dict[str, Any]] = Field(
        description="per metric: key, count, latest {step, value}, best {step, value}, "
                    "direction (min|max), trend (improving|worsening|flat|unknown)")


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


class ControlOut(Out):
    next_actions: list[NextAction] = []


class DiagnosisOut(Out):
    run_id: int
    verdict: Literal["healthy", "diverging", "plateaued", "overfitting", "stalled", "failed",
                     "too early to tell"]
    summary: str
    evidence: list[str]
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
    checkpoint: dict[str, Any] | None
    runner_up: dict[str, Any] | None = None
    margin: float | None = None
    reason: str
    next_actions: list[NextAction] = []


class ExplanationOut(Out):
    job_id: int
    kind: str = Field(description="CUDA_OOM, NCCL, MISSING_MODULE, MISSING_FILE, CUDA_ERROR, "
                                  "PERMISSION, KILLED, PYTHON_EXCEPTION, DISPATCH_FAILED, "
                                  "NODE_LOST, CANCELLED, EXIT_CODE or NOT_FAILED")
    summary: str
    lines: list[dict[str, Any]]
    suggestions: list[str]
    next_actions: list[NextAction]


def act(tool, why, **arguments):
    return {"tool": tool, "arguments": arguments, "why": why}


# -- the tools, as plain functions of a Gpuplane (testable without the mcp package) -------------

class Gpuplane:
    """The tools' implementation: REST calls and the shaping of their answers."""

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
        with self._lock:
            c = self._callers.get(token)
            if c is None:
                if len(self._callers) >= MAX_CALLERS:
                    self._callers.pop(next(iter(self._callers))).close()
                c = self._callers[token] = Client(self._default.server, token,
                                                  timeout=self._timeout)
            return c

    # plumbing

    def call(self, what, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (ServerUnreachable, ApiError) as e:
            self.fail(what, e)

    def fail(self, what, e):
        """Raise the ToolFailure that tells the agent what went wrong and what to do."""
        if isinstance(e, ServerUnreachable):
            raise ToolFailure(
                f"the GPUPlane server at {self.client.server} is not reachable ({e.reason}); "
                "start it (`gpuplane up` or `gpuplane server`) or point GPUCTL_SERVER at it, "
                "then call the tool again") from None
        if e.status == 401:
            fix = ("send a valid one in the Authorization header" if _caller_token.get()
                   else "give gpuplane-mcp a valid token in GPUCTL_TOKEN or --token")
            raise ToolFailure(f"Unauthorized: the server refused the token ({e.message}); "
                              f"{fix}") from None
        if e.code == "WriteScopeError":
            raise ToolFailure(f"WriteScopeError: {e.message}") from None
        if _route_missing(e):
            raise ToolFailure(
                f"this GPUPlane server cannot {what} yet (its REST API has no such "
                f"route); upgrade the server") from None
        raise ToolFailure(f"{e.code}: {e.message}") from None

    def need_write(self, tool):
        who = self.whoami_cached()
        if not who.get("can_write"):
            raise ToolFailure(
                f"WriteScopeError: {tool} changes the platform and this token "
                f"({who.get('name')!r}) has {who.get('scope')} scope; restart gpuplane-mcp with "
                "a write token (`gpuplane token create --name NAME --scope write`)")

    def whoami_cached(self):
        client = self.client
        with self._lock:
            hit = self._whoami.get(client.token)
            if hit and time.monotonic() - hit[0] < WHOAMI_TTL_S:
                return hit[1]
        who = self.call("say who you are", client.whoami)
        with self._lock:
            if len(self._whoami) >= MAX_CALLERS:
                self._whoami.pop(next(iter(self._whoami)))
            self._whoami[client.token] = (time.monotonic(), who)
        return who

    # observe

    def get_status(self):
        s = self.call("show its status", self.client.status)
        gpus = [g for n in s.get("nodes", []) for g in n.get("gpus", [])]
        free = [g for g in gpus if not g.get("job_id")]
        nodes_up = [n for n in s.get("nodes", []) if n.get("state") == "connected"]
        summary = (f"{len(nodes_up)} of {len(s.get('nodes', []))} nodes connected, "
                   f"{len(free)} of {len(gpus)} GPUs free, {len(s.get('running', []))} "
                   f"jobs running, {len(s.get('queue', []))} queued")
        return StatusOut(nodes=s.get("nodes", []), queue=s.get("queue", []),
                         running=s.get("running", []), summary=summary)

    def list_jobs(self, state=None, limit=50):
        jobs = self.call("list jobs", self.client.list_jobs, state=state, limit=limit)
        return JobsOut(jobs=jobs, count=len(jobs))

    def get_job(self, job_id):
        job = self.call("show a job", self.client.get_job, job_id)
        acts = []
        if job["state"] in ("FAILED",):
            acts.append(act("explain_failure", "find out why it failed", job_id=job_id))
        elif job["state"] not in FINAL:
            acts.append(act("wait_for_job", "wait until it ends or an event arrives",
                            job_id=job_id, timeout_s=300))
        if job.get("run_id"):
            acts.append(act("diagnose_run", "judge its curves", run_id=job["run_id"]))
        return JobOut(**job, next_actions=acts)

    def get_job_logs(self, job_id, tail=100):
        return LogsOut(**self.call("show logs", self.client.logs, job_id, tail=tail))

    def list_runs(self, project=None, experiment=None, job_id=None, limit=50):
        runs = self.call("list runs", self.client.list_runs, project=project,
                         experiment=experiment, job_id=job_id, limit=limit)
        return RunsOut(runs=runs, count=len(runs))

    def get_run(self, run_id):
        return RunOut(**self.call("show a run", self.client.get_run, run_id))

    def get_metric_summary(self, run_id):
        return MetricSummaryOut(run_id=run_id, keys=self.call(
            "summarise metrics", self.client.run_metrics, run_id))

    def get_metric_series(self, run_id, key, max_points=200, from_step=None, to_step=None):
        return MetricSeriesOut(**self.call("give a metric series", self.client.metric_series,
                                           run_id, key, max_points=max_points,
                                           from_step=from_step, to_step=to_step))

    def list_checkpoints(self, run_id):
        data = self.call("list checkpoints", self.client.list_checkpoints, run_id)
        cks = data.get("checkpoints", data) if isinstance(data, dict) else data
        return CheckpointsOut(run_id=run_id, checkpoints=cks)

    def list_events(self, run_id=None, job_id=None, type=None, severity=None, since=None,
                    after=None, limit=100):
        try:
            data = self.client.list_events(run=run_id, job=job_id, type=type,
                                           severity=severity, since=since, after=after,
                                           limit=limit)
        except (ServerUnreachable, ApiError) as e:
            if not (isinstance(e, ApiError) and _route_missing(e)):
                self.fail("list events", e)
            if run_id is None or any(x is not None for x in (job_id, type, severity, since)):
                raise ToolFailure(
                    "this GPUPlane server cannot filter events by job, type, severity or "
                    "time yet (no GET /api/v1/events); give run_id alone, or upgrade the "
                    "server") from None
            data = self.call("list events", self.client.run_events, run_id, after=after,
                             limit=limit)
        return EventsOut(events=data.get("events", []))

    def whoami(self):
        who = self.whoami_cached()
        return WhoAmIOut(name=who["name"], scope=who["scope"], can_write=who["can_write"],
                         server=self.client.server)

    # wait

    def wait_for_job(self, job_id, timeout_s=300, until="end"):
        deadline = time.monotonic() + timeout_s
        start = time.monotonic()
        job = self.call("show a job", self.client.get_job, job_id)
        first_state = job["state"]
        after = self._last_event_id(job)
        seen, total = [], 0
        while True:
            new = self._job_events(job, after)
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
            job = self.call("show a job", self.client.get_job, job_id)
        timed_out = not reached
        acts = []
        run_id = job.get("run_id")
        if state == "FAILED":
            acts.append(act("explain_failure", "find out why it failed", job_id=job_id))
        elif state == "SUCCEEDED" and run_id:
            acts.append(act("diagnose_run", "judge the finished run", run_id=run_id))
            acts.append(act("list_checkpoints", "see what it saved", run_id=run_id))
        elif state not in FINAL:
            if run_id and state == "RUNNING":
                acts.append(act("diagnose_run", "judge the curves so far", run_id=run_id))
            acts.append(act("wait_for_job", "keep waiting", job_id=job_id,
                            timeout_s=timeout_s, until=until))
        return WaitOut(job_id=job_id, state=state, reached=reached, timed_out=timed_out,
                       waited_s=round(time.monotonic() - start, 2), events=seen,
                       events_total=total,
                       run_id=run_id, next_actions=acts)

    def _last_event_id(self, job):
        evs = self._job_events(job, None, limit=1)
        return evs[-1]["id"] if evs else 0

    def _job_events(self, job, after, limit=200):
        """The job's events after id `after`, oldest first (after=None: the latest `limit`).
        GET /events?job= where the server has it (issue 12), else the run's own events."""
        try:
            data = self.client.list_events(job=job["id"], after=after, limit=limit)
            return data.get("events", [])
        except (ServerUnreachable, ApiError) as e:
            if not (isinstance(e, ApiError) and _route_missing(e)):
                self.fail("list events", e)
        if not job.get("run_id"):
            return []
        data = self.call("list events", self.client.run_events, job["run_id"], after=after,
                         limit=limit)
        return data.get("events", [])

    # control

    def submit_job(self, command, working_dir, **fields):
        self.need_write("submit_job")
        job = self.call("submit jobs", self.client.submit_job, command, working_dir, **fields)
        return ControlOut(**job, next_actions=[
            act("wait_for_job", "wait until it ends (or an event arrives)",
                job_id=job["id"], timeout_s=600)])

    def cancel_job(self, job_id):
        self.need_write("cancel_job")
        job = self.call("cancel jobs", self.client.cancel_job, job_id)
        return ControlOut(**job, next_actions=[
            act("wait_for_job", "wait until the cancel has taken effect", job_id=job_id,
                timeout_s=30)])

    def retry_job(self, job_id):
        self.need_write("retry_job")
        job = self.call("retry jobs", self.client.retry_job, job_id)
        return ControlOut(**job, next_actions=[
            act("wait_for_job", "wait for the new attempt", job_id=job_id, timeout_s=600)])

    def evaluate_checkpoint(self, checkpoint_id, command=None):
        self.need_write("evaluate_checkpoint")
        ev = self.call("evaluate checkpoints", self.client.evaluate_checkpoint,
                       checkpoint_id, command)
        acts = []
        if ev.get("job_id"):
            acts.append(act("wait_for_job", "wait for the evaluation job; its results attach "
                            "to the checkpoint", job_id=ev["job_id"], timeout_s=600))
        acts.append(act("compare_checkpoints", "once evaluated, rankings use the evaluation",
                        run_ids=["<the checkpoint's run>"]))
        return ControlOut(**ev, next_actions=acts)

    def set_primary_metric(self, key, direction, project=None, experiment=None):
        self.need_write("set_primary_metric")
        d = self.call("set metric definitions", self.client.set_metric_definition, key,
                      direction=direction, primary=True, project=project,
                      experiment=experiment)
        return ControlOut(**d, next_actions=[
            act("get_best_checkpoint", f"recommendations now rank by {key}",
                experiment=experiment, project=project)])

    # semantic

    def diagnose_run(self, run_id, key=None):
        return DiagnosisOut(**self.call("diagnose runs", self.client.diagnose_run, run_id,
                                        key=key))

    def compare_runs(self, run_ids, keys=None, key=None):
        if len(set(run_ids)) < 2:
            raise ToolFailure("compare_runs needs at least two different run ids, e.g. "
                              "run_ids=[3, 4]; list_runs shows them")
        data = self.call("compare runs", self.client.compare_runs, run_ids, keys=keys, key=key)
        # The aligned overlay series (for charts) would flood an agent's context; the
        # per-metric best / final / noise say what it needs. get_metric_series has curves.
        data.pop("series", None)
        return CompareRunsOut(**data)

    def compare_checkpoints(self, run_ids, key=None):
        return CompareCheckpointsOut(**self.call("compare checkpoints",
                                                 self.client.compare_checkpoints, run_ids,
                                                 key=key))

    def get_best_checkpoint(self, run_id=None, experiment=None, project=None, key=None):
        if run_id is None and not experiment and not project:
            raise ToolFailure("give run_id, experiment or project: the scope to pick the "
                              "best checkpoint from")
        try:
            data = self.client.recommend_checkpoint(run=run_id, experiment=experiment,
                                                    project=project, key=key)
        except (ServerUnreachable, ApiError) as e:
            if not (isinstance(e, ApiError) and _route_missing(e)) or run_id is None:
                self.fail("recommend checkpoints", e)
            # A server without issue 11's recommend route: rank the run's checkpoints.
            data = self.call("recommend checkpoints", self.client.compare_checkpoints,
                             [run_id], key=key)
            data = dict(data.pop("recommendation"), key=data["key"],
                        direction=data["direction"], next_actions=data["next_actions"])
        data.setdefault("reason", "")
        data.setdefault("next_actions", [])
        return BestCheckpointOut(**data)

    def explain_failure(self, job_id):
        return ExplanationOut(**self.call("explain failures", self.client.explain_failure,
                                          job_id))


def _route_missing(e):
    return (e.status == 404 and e.message.startswith("no such route")) or e.status == 405


# -- the MCP server ----------------------------------------------------------------------------

RunId = Annotated[int, Field(description="a run's id (list_runs, or get_job's run_id)", ge=1)]
JobId = Annotated[int, Field(description="a job's id (list_jobs, or submit_job's answer)", ge=1)]


def build_server(gp):
    """The MCPServer with every tool registered (imports mcp: ~1.5 s)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    async def caller_token(ctx, call_next):
        # Over HTTP a caller may send its own GPUPlane token; its calls then run with it.
        headers = getattr(getattr(ctx, "request", None), "headers", None)
        auth = headers.get("authorization", "") if headers is not None else ""
        if auth[:7].lower() != "bearer " or not auth[7:].strip():
            return await call_next(ctx)
        mark = _caller_token.set(auth[7:].strip())
        try:
            return await call_next(ctx)
        finally:
            _caller_token.reset(mark)

    server = MCPServer("gpuplane", instructions=INSTRUCTIONS, middleware=[caller_token])

    def tool(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            try:
                return fn(*a, **kw)
            except ToolFailure as e:
                raise ToolError(str(e)) from None
        description = " ".join(inspect.cleandoc(fn.__doc__).split())
        return server.tool(description=description)(wrapper)

    # observe ---------------------------------------------------------------------------------

    @tool
    def get_status() -> StatusOut:
        """Nodes, their GPUs (which job holds each slot, utilisation, memory), running jobs
        and the queue. Start here to see whether a GPU is free before submitting."""
        return gp.get_status()

    @tool
    def list_jobs(
        state: Annotated[Literal["QUEUED", "DISPATCHED", "RUNNING", "SUCCEEDED", "FAILED",
                                 "CANCELLED"] | None,
                         Field(description="only jobs in this state")] = None,
        limit: Annotated[int, Field(description="at most this many, newest first",
                                    ge=1, le=1000)] = 50,
    ) -> JobsOut:
        """Jobs, newest first, with state, node, GPUs and current run_id."""
        return gp.list_jobs(state, limit)

    @tool
    def get_job(job_id: JobId) -> JobOut:
        """One job: state, command, working dir, failure kind and exit code, and its
        attempts (each attempt is a run, with its run_id)."""
        return gp.get_job(job_id)

    @tool
    def get_job_logs(
        job_id: JobId,
        tail: Annotated[int, Field(description="how many of the last lines", ge=1,
                                   le=2000)] = 100,
    ) -> LogsOut:
        """The last lines a job printed (the server keeps the last 2000 per job)."""
        return gp.get_job_logs(job_id, tail)

    @tool
    def list_runs(
        project: Annotated[str | None, Field(description="only runs of this project")] = None,
        experiment: Annotated[str | None, Field(description="only runs of this experiment")] = None,
        job_id: Annotated[int | None,
                          Field(description="only the runs (attempts) of this job")] = None,
        limit: Annotated[int, Field(description="at most this many, newest first",
                                    ge=1, le=1000)] = 50,
    ) -> RunsOut:
        """Runs (one per job attempt, or registered by the SDK), newest first, with state
        and config (hyperparameters)."""
        return gp.list_runs(project, experiment, job_id, limit)

    @tool
    def get_run(run_id: RunId) -> RunOut:
        """One run: state, job, node, GPUs, config, exit code, failure kind, times."""
        return gp.get_run(run_id)

    @tool
    def get_metric_summary(run_id: RunId) -> MetricSummaryOut:
        """Per metric of a run: latest value, best value and its step (by the metric's
        direction), trend and point count. Cheap whatever the run's length."""
        return gp.get_metric_summary(run_id)

    @tool
    def get_metric_series(
        run_id: RunId,
        key: Annotated[str, Field(description="the metric, e.g. 'train/loss' "
                                              "(get_metric_summary lists them)")],
        max_points: Annotated[int, Field(description="at most this many buckets",
                                         ge=2, le=2000)] = 200,
        from_step: Annotated[int | None, Field(description="first step", ge=0)] = None,
        to_step: Annotated[int | None, Field(description="last step", ge=0)] = None,
    ) -> MetricSeriesOut:
        """A metric's curve downsampled to at most max_points buckets of
        [step, min, max, mean, last, count]; non-finite values come as "NaN"/"Infinity";
        ts[i] is when bucket i was logged (ms since the epoch)."""
        return gp.get_metric_series(run_id, key, max_points, from_step, to_step)

    @tool
    def list_checkpoints(run_id: RunId) -> CheckpointsOut:
        """The checkpoints a run saved (path, step, size) and their evaluations."""
        return gp.list_checkpoints(run_id)

    @tool
    def list_events(
        run_id: Annotated[int | None, Field(description="only events of this run")] = None,
        job_id: Annotated[int | None, Field(description="only events of this job")] = None,
        type: Annotated[str | None, Field(description="only these types, comma-separated, "
                                                      "e.g. 'FAILED,LOSS_NAN'")] = None,
        severity: Annotated[Literal["info", "warning", "critical"] | None,
                            Field(description="at least this severity")] = None,
        since: Annotated[int | str | None, Field(
            description="only events after this time: ms since the epoch, an ISO 8601 time "
                        "or an age like '30m', '2h'")] = None,
        after: Annotated[int | None, Field(description="only events after this event id "
                                                       "(the last one you saw)", ge=0)] = None,
        limit: Annotated[int, Field(description="at most this many, newest kept",
                                    ge=1, le=1000)] = 100,
    ) -> EventsOut:
        """Events, oldest first: lifecycle (QUEUED, DISPATCHED, STARTED, SUCCEEDED, FAILED,
        CANCELLED, RETRIED, NODE_UP, NODE_DOWN) and rule findings (LOSS_NAN, OOM, LOSS_SPIKE,
        OVERFITTING_SUSPECTED, GPU_UNDERUTILIZED, STALLED, DISK_LOW), each with a severity,
        a message and its evidence."""
        return gp.list_events(run_id, job_id, type, severity, since, after=after, limit=limit)

    @tool
    def whoami() -> WhoAmIOut:
        """The token this MCP server uses: its name, scope and whether it can write
        (submit, cancel, retry, evaluate, set metrics), and the server's URL."""
        return gp.whoami()

    # wait --------------------------------------------------------------------------------------

    @tool
    def wait_for_job(
        job_id: JobId,
        timeout_s: Annotated[int, Field(description="give up after this many seconds",
                                        ge=1, le=WAIT_MAX_S)] = 300,
        until: Annotated[Literal["end", "running", "change"],
                         Field(description="'end': the job finished, failed or was cancelled; "
                                           "'running': it started; 'change': any state change "
                                           "or new event (an ended job returns at once)")] = "end",
    ) -> WaitOut:
        """Block until a job ends (or starts, or anything happens to it), or the timeout.
        Use this instead of polling get_job; it returns the events that arrived meanwhile
        and what to do next."""
        return gp.wait_for_job(job_id, timeout_s, until)

    # control -----------------------------------------------------------------------------------

    @tool
    def submit_job(
        command: Annotated[list[str] | str, Field(
            description="argv list, e.g. ['python', 'train.py', '--lr', '0.01'], or one shell "
                        "string")],
        working_dir: Annotated[str, Field(description="absolute directory on the agent's host "
                                                      "to run in")],
        name: Annotated[str | None, Field(description="a short name for the job")] = None,
        gpus: Annotated[int | None, Field(description="GPUs on one node (default 1)",
                                          ge=0, le=64)] = None,
        cpu_only: Annotated[bool | None, Field(description="needs no GPU")] = None,
        priority: Annotated[int | None, Field(description="higher starts first",
                                              ge=-1000, le=1000)] = None,
        max_attempts: Annotated[int | None, Field(description="retries for node loss etc.",
                                                  ge=1, le=100)] = None,
        env: Annotated[dict[str, str] | None, Field(description="extra environment")] = None,
        project: Annotated[str | None, Field(description="project to file the run under")] = None,
        experiment: Annotated[str | None,
                              Field(description="experiment within the project")] = None,
        tb_dir: Annotated[str | None, Field(description="TensorBoard log dir to tail "
                                                        "(relative to working_dir)")] = None,
        watch_dir: Annotated[str | None, Field(description="checkpoint dir to watch "
                                                           "(relative to working_dir)")] = None,
        eval_command: Annotated[list[str] | str | None, Field(
            description="how to evaluate one of its checkpoints, e.g. ['python', 'eval.py']; "
                        "evaluate_checkpoint runs it with GPUCTL_CHECKPOINT_PATH set")] = None,
    ) -> ControlOut:
        """Queue a training job (needs a write token). Returns the job; then call
        wait_for_job with its id."""
        return gp.submit_job(command, working_dir, name=name, gpus=gpus, cpu_only=cpu_only,
                             priority=priority, max_attempts=max_attempts, env=env,
                             project=project, experiment=experiment, tb_dir=tb_dir,
                             watch_dir=watch_dir, eval_command=eval_command)

    @tool
    def cancel_job(job_id: JobId) -> ControlOut:
        """Cancel a queued or running job: SIGTERM to its process group, SIGKILL after 5 s
        (needs a write token)."""
        return gp.cancel_job(job_id)

    @tool
    def retry_job(job_id: JobId) -> ControlOut:
        """Put a FAILED or CANCELLED job back in the queue as a new attempt (a new run;
        needs a write token)."""
        return gp.retry_job(job_id)

    @tool
    def evaluate_checkpoint(
        checkpoint_id: Annotated[int, Field(description="the checkpoint (list_checkpoints)", ge=1)],
        command: Annotated[list[str] | None, Field(
            description="evaluation command; default: the training job's eval command")] = None,
    ) -> ControlOut:
        """Queue an EVALUATE job for a checkpoint; its results attach to the checkpoint and
        then drive get_best_checkpoint (needs a write token)."""
        return gp.evaluate_checkpoint(checkpoint_id, command)

    @tool
    def set_primary_metric(
        key: Annotated[str, Field(description="the metric that decides, e.g. 'val/acc'")],
        direction: Annotated[Literal["min", "max"], Field(description="whether lower or "
                                                                      "higher is better")],
        project: Annotated[str | None, Field(description="scope: this project only")] = None,
        experiment: Annotated[str | None, Field(description="scope: this experiment only "
                                                            "(with project)")] = None,
    ) -> ControlOut:
        """Make a metric the primary one (global, project or experiment scope): checkpoint
        recommendations and comparisons rank by it (needs a write token)."""
        return gp.set_primary_metric(key, direction, project, experiment)

    # semantic ----------------------------------------------------------------------------------

    @tool
    def diagnose_run(
        run_id: RunId,
        key: Annotated[str | None, Field(description="the metric to judge (default: the "
                                                     "primary one)")] = None,
    ) -> DiagnosisOut:
        """Judge a run: healthy, diverging, plateaued, overfitting, stalled, failed or too
        early to tell, with the evidence and next_actions (tool calls to make next)."""
        return gp.diagnose_run(run_id, key)

    @tool
    def compare_runs(
        run_ids: Annotated[list[int], Field(description="two or more run ids",
                                            min_length=2, max_length=20)],
        keys: Annotated[list[str] | None, Field(description="only these metrics")] = None,
        key: Annotated[str | None, Field(description="the metric that names the winner "
                                                     "(default: the primary one)")] = None,
    ) -> CompareRunsOut:
        """Runs side by side: per metric best, final and step of best, the winner by the
        metric's direction, whether the margin exceeds the runs' own noise, and the config
        keys that differ."""
        return gp.compare_runs(run_ids, keys, key)

    @tool
    def compare_checkpoints(
        run_ids: Annotated[list[int], Field(description="the runs whose checkpoints to rank",
                                            min_length=1, max_length=20)],
        key: Annotated[str | None, Field(description="rank by this metric (default: the "
                                                     "primary one)")] = None,
    ) -> CompareCheckpointsOut:
        """The checkpoints of one or more runs ranked: evaluated values first, then the
        training value at the checkpoint's step."""
        return gp.compare_checkpoints(run_ids, key)

    @tool
    def get_best_checkpoint(
        run_id: Annotated[int | None, Field(description="pick within this run")] = None,
        experiment: Annotated[str | None, Field(description="pick within this experiment")] = None,
        project: Annotated[str | None, Field(description="pick within this project")] = None,
        key: Annotated[str | None, Field(description="rank by this metric (default: the "
                                                     "primary one)")] = None,
    ) -> BestCheckpointOut:
        """The checkpoint to keep, with the reason, the runner-up and the margin."""
        return gp.get_best_checkpoint(run_id, experiment, project, key)

    @tool
    def explain_failure(job_id: JobId) -> ExplanationOut:
        """Why a job failed: the kind (CUDA OOM, NCCL, missing module or file, killed by a
        signal, Python exception, ...), the relevant log lines and what to try."""
        return gp.explain_failure(job_id)

    return server


def get_parser():
    p = argparse.ArgumentParser(
        prog="gpuplane-mcp",
        description="GPUPlane as MCP tools for coding agents (stdio by default).")
    p.add_argument("--server", help="GPUPlane server URL (default $GPUCTL_SERVER, else the "
                                    "local server.toml's, else http://127.0.0.1:8600)")
    p.add_argument("--token", help="API token (default $GPUCTL_MCP_TOKEN, $GPUCTL_TOKEN, "
                                   "else the local admin token)")
    p.add_argument("--http", type=int, metavar="PORT",
                   help="serve streamable HTTP on PORT (path /mcp) instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="address for --http (default 127.0.0.1)")
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    token = args.token or os.environ.get("GPUCTL_MCP_TOKEN") or None
    gp = Gpuplane(args.server, token)
    server = build_server(gp)
    if args.http:
        print(f"gpuplane-mcp: serving http://{args.host}:{args.http}/mcp for "
              f"{gp.client.server}", file=sys.stderr, flush=True)
        server.run("streamable-http", host=args.host, port=args.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
