"""next_actions: the MCP tool calls an answer suggests, with their arguments filled in,
and the same next steps as `gpuplane` commands.

Every suggestion, whether the server's semantic layer (gpuplane/semantic.py) makes it or
gpuplane-mcp does (after a wait, a submit, an evaluation), is built by `action` here, and the
ones about jobs are built by the functions below. tests/test_mcp.py checks each tool named
against the MCP tool table (mcp_server.TOOLS) and that every argument it needs is filled.
An answer carries tool calls (MCP shows them as they are); the CLI prints each as the
command that does the same (`cli_command`, from the table CLI), and
tests/test_newcomer.py parses every form with the CLI's own parser.
Pure functions of plain data: no I/O, nothing of the server or of mcp.
"""
import shlex

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def action(tool, why, **arguments):
    """One suggested call: {"tool", "arguments", "why"}; arguments that are None are left
    out (the tool's default applies)."""
    return {"tool": tool, "arguments": {k: v for k, v in arguments.items() if v is not None},
            "why": why}


def resubmit(job, why):
    """[submit_job with the job's own command, working dir and scope] — real values, which
    the agent changes as `why` says before it submits — or [] when no job ran it."""
    if not job or not job.get("command") or not job.get("working_dir"):
        return []
    return [action("submit_job", why, command=job["command"], working_dir=job["working_dir"],
                   cpu_only=job.get("cpu_only") or None, project=job.get("project"),
                   experiment=job.get("experiment") or None)]


def after_job(job, timeout_s=300, until="end", trained=None):
    """What to do with a job in the state it is in (get_job, wait_for_job). An evaluation
    (`trained`: the run whose checkpoint it scored) points at that checkpoint's ranking,
    not at its own run."""
    state, job_id, run_id = job["state"], job["id"], job.get("run_id")
    if state == "FAILED":
        return [action("explain_failure", "find out why it failed", job_id=job_id)]
    if state == "SUCCEEDED" and job.get("kind") == "EVALUATE":
        acts = []
        if trained:
            acts.append(action("compare_checkpoints", "rank the run's checkpoints with this "
                               "evaluation in", run_ids=[trained]))
        if job.get("project"):
            acts.append(action("get_best_checkpoint", "the checkpoint to keep in the "
                               "experiment", project=job["project"],
                               experiment=job.get("experiment") or None))
        return acts
    if state == "SUCCEEDED" and run_id:
        return [action("diagnose_run", "judge the finished run", run_id=run_id),
                action("list_checkpoints", "see what it saved", run_id=run_id)]
    if state in FINAL:
        return []
    acts = []
    if run_id and state == "RUNNING":
        acts.append(action("diagnose_run", "judge the curves so far", run_id=run_id))
    acts.append(action("wait_for_job", "keep waiting", job_id=job_id, timeout_s=timeout_s,
                       until=until))
    return acts


def after_event(event, jobs):
    """After wait_for_jobs returned on a critical event: look at the run, or stop the job
    (it goes on unless it stops on that event itself)."""
    job = next((j for j in jobs if j["job_id"] == event.get("job_id")), {})
    acts = []
    if job.get("state") not in FINAL:
        acts.append(action("cancel_job", f"stop job {event['job_id']}: {event['type']}",
                           job_id=event["job_id"]))
    if event.get("run_id"):
        acts.append(action("diagnose_run", "look at the curve the event is about",
                           run_id=event["run_id"]))
    return acts


def after_jobs(jobs, pending, timeout_s=600, mode="all", until="end"):
    """After wait_for_jobs: wait on for the pending, explain the failed, compare the
    trainings that succeeded, rank the checkpoints the evaluations scored."""
    acts = []
    if pending:
        acts.append(action("wait_for_jobs", "keep waiting for the rest",
                           job_ids=pending, timeout_s=timeout_s, mode=mode,
                           **({"until": until} if until != "end" else {})))
    for j in [j for j in jobs if j["state"] == "FAILED"][:3]:
        acts.append(action("explain_failure", f"find out why job {j['job_id']} failed",
                           job_id=j["job_id"]))
    done = [j for j in jobs if j["state"] == "SUCCEEDED" and j.get("run_id")]
    trained = [j["run_id"] for j in done if j.get("kind") != "EVALUATE"]
    if len(trained) >= 2:
        acts.append(action("compare_runs", "which setting won, and by more than the noise",
                           run_ids=trained[:20]))
    elif trained:
        acts.append(action("diagnose_run", "judge the finished run", run_id=trained[0]))
    scored = sorted({j["trained_run_id"] for j in done
                     if j.get("kind") == "EVALUATE" and j.get("trained_run_id")})
    if scored:
        acts.append(action("compare_checkpoints", "rank the evaluated checkpoints of those "
                           "runs", run_ids=scored[:20]))
    scopes = {(j.get("project"), j.get("experiment")) for j in done
              if j.get("kind") == "EVALUATE" and j.get("project")}
    for project, experiment in sorted(scopes, key=str)[:3]:
        acts.append(action("get_best_checkpoint", "the checkpoint to keep, now that the "
                           "evaluations are in", project=project,
                           experiment=experiment or None))
    return acts


def after_submit(job):
    return [action("wait_for_job", "wait until it ends (or an event arrives)",
                   job_id=job["id"], timeout_s=600)]


def after_cancel(job):
    return [action("wait_for_job", "wait until the cancel has taken effect",
                   job_id=job["id"], timeout_s=30)]


def after_retry(job):
    return [action("wait_for_job", "wait for the new attempt", job_id=job["id"],
                   timeout_s=600)]


def after_evaluation(evaluation, checkpoint_run_id=None):
    acts = []
    if evaluation.get("job_id"):
        acts.append(action("wait_for_job", "wait for the evaluation job; its results "
                           "attach to the checkpoint", job_id=evaluation["job_id"],
                           timeout_s=600))
    if checkpoint_run_id:
        acts.append(action("compare_checkpoints", "once evaluated, rankings use the "
                           "evaluation", run_ids=[checkpoint_run_id]))
    return acts


def after_prune(result):
    """After a dry run that would delete something: the same policy, for real."""
    if not result.get("dry_run") or not result.get("delete"):
        return []
    policy = result["policy"]
    return [action("prune_checkpoints", f"delete these {len(result['delete'])} checkpoint "
                   "files (what is kept and why is listed)", job_id=result["job_id"],
                   keep_best=policy["keep_best"], keep_last=policy["keep_last"],
                   dry_run=False)]


def after_primary_metric(key, project=None, experiment=None):
    if not project and not experiment:
        return []
    return [action("get_best_checkpoint", f"recommendations now rank by {key}",
                   experiment=experiment, project=project)]


def after_sweep(sweep, timeout_s=600):
    """What to do with a sweep in the state it is in (create, get, wait, retry): wait while
    it runs; when it ended, the best checkpoint across its trials, the leading trials
    compared, the best run judged; for one stopped by failing trials, why and a re-run."""
    sweep_id, state = sweep["id"], sweep["state"]
    trials = sweep.get("trials_detail") or []
    if state == "RUNNING":
        return [action("wait_for_sweep", "wait until every trial has ended",
                       sweep_id=sweep_id, timeout_s=timeout_s)]
    acts = []
    failed = [t for t in trials if t.get("state") == "FAILED" and t.get("job_id")]
    if state == "STOPPED" and failed:
        acts.append(action("explain_failure", f"find out why trial {failed[0]['number']} "
                           "failed", job_id=failed[0]["job_id"]))
        acts.append(action("retry_failed_sweep", "once the command is fixed, run the failed "
                           "trials again with their parameters", sweep_id=sweep_id))
    scored = [t for t in trials if t.get("run_id") and isinstance(
        (t.get("value") or {}).get("value"), (int, float))]
    d = (sweep.get("metric") or {}).get("direction")
    scored.sort(key=lambda t: t["value"]["value"] * (-1 if d == "max" else 1))
    if scored:
        acts.append(action("get_best_checkpoint", "the checkpoint to keep across all trials",
                           sweep_id=sweep_id))
    if len(scored) >= 2:
        acts.append(action("compare_runs", "the leading trials side by side: by more than "
                           "the noise?", run_ids=[t["run_id"] for t in scored[:3]]))
    if scored:
        acts.append(action("diagnose_run", "judge the best trial's curves",
                           run_id=scored[0]["run_id"]))
    return acts


# -- the same next steps as CLI commands -----------------------------------------------------

# tool: (the gpuplane command's words, the arguments given as its positionals, in order,
# {argument: its flag}, the arguments a terminal leaves out). A flag is "--name" (followed
# by the value; a list repeats it), "--name" for a bool (given when true), {value: flag} for
# a choice, ("--name", "line") for a command given as one word (a list is joined as a
# shell line), or "--" for a command after `--`. Left out: the timeouts of a tool call (a
# person presses Ctrl-C) and what the command already does by default.
CLI = {
    "cancel_job": ("job cancel", ["job_id"], {}, ()),
    "compare_checkpoints": ("ckpt compare", ["run_ids"], {"key": "--key"}, ()),
    "compare_runs": ("run compare", ["run_ids"], {"key": "--key", "keys": "--metric"}, ()),
    "diagnose_run": ("diagnose", ["run_id"], {"key": "--key"}, ()),
    "evaluate_checkpoint": ("ckpt evaluate", ["checkpoint_id"], {"command": "--"}, ()),
    "explain_failure": ("explain", ["job_id"], {}, ()),
    "get_best_checkpoint": ("ckpt recommend", [], {
        "run_id": "--run", "sweep_id": "--sweep", "project": "--project",
        "experiment": "--experiment", "key": "--key"}, ()),
    "get_job_logs": ("logs", ["job_id"], {"tail": "--tail"}, ()),
    "get_metric_summary": ("run show", ["run_id"], {}, ("include_system",)),
    "list_checkpoints": ("ckpt list", [], {"run_id": "--run"}, ()),
    "prune_checkpoints": ("ckpt prune", [], {
        "job_id": "--job", "keep_best": "--keep-best", "keep_last": "--keep-last",
        "dry_run": "--dry-run"}, ()),
    "retry_failed_sweep": ("sweep retry-failed", ["sweep_id"], {}, ()),
    "retry_job": ("job retry", ["job_id"], {}, ()),
    "set_primary_metric": ("metric set --primary", ["key"], {
        "direction": "--direction", "project": "--project", "experiment": "--experiment"}, ()),
    "submit_job": ("job submit", [], {
        "name": "-n", "gpus": "-g", "working_dir": "-d", "cpu_only": "--cpu-only",
        "priority": "--priority", "max_attempts": "--max-attempts", "env": "--env",
        "project": "--project", "experiment": "--experiment", "tb_dir": "--tb-dir",
        "watch_dir": "--watch", "eval_command": ("--eval-command", "line"),
        "time_limit": "--time", "preemptible": {True: "--preemptible", False: "--no-preemptible"},
        "stop_on": "--stop-on", "command": "--"}, ()),
    # `job wait` waits for the end, which is also past the start or any change
    "wait_for_job": ("job wait", ["job_id"], {}, ("timeout_s", "until")),
    "wait_for_jobs": ("job wait", ["job_ids"], {"mode": {"any": "--any", "all": None},
                                                "until": {"event": "--until-event",
                                                          "end": None}},
                      ("timeout_s",)),
    "wait_for_sweep": ("sweep show", ["sweep_id"], {}, ("timeout_s",)),
}


def _words(value):
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, dict):
        return [f"{k}={v}" for k, v in value.items()]
    return [str(value)]


def cli_command(act):
    """The `gpuplane ...` command line that does what the tool call `act` does, or None
    for a tool the CLI has no command for."""
    form = CLI.get(act["tool"])
    if form is None:
        return None
    words, positional, flags, _ = form
    args = act["arguments"]
    out = ["gpuplane", *words.split()]
    for name in positional:
        if args.get(name) is not None:
            out += _words(args[name])
    after = []
    for name, flag in flags.items():
        value = args.get(name)
        if value is None:
            continue
        if isinstance(flag, dict):
            flag = flag.get(value)
            if flag:
                out.append(flag)
        elif value is False:
            continue
        elif isinstance(flag, tuple):
            out += [flag[0], shlex.join(value) if isinstance(value, list) else str(value)]
        elif flag == "--":
            after = ["--", *(_words(value) if isinstance(value, list) else [value])]
        elif value is True:
            out.append(flag)
        else:
            for word in _words(value):
                out += [flag, word]
    return shlex.join(out + after)
