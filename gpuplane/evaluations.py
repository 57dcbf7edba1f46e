"""Queue the evaluation of a checkpoint: an EVALUATE job that inherits the training job's
working dir, GPUs and env, and gets GPUCTL_CHECKPOINT_ID / GPUCTL_CHECKPOINT_PATH /
GPUCTL_CHECKPOINT_STEP. What its run logs through the SDK are the evaluation's results.
The agent refuses to start it when the checkpoint is gone (DISPATCH_FAILED, see
docs/protocol.md `require_paths`)."""
import posixpath

from .db import checkpoints, jobs, runs
from .errors import BadRequest, Conflict
from .lifecycle import LimitRefused


def queue(db, lifecycle, ckpt, command=None, working_dir=None, gpus=None, cpu_only=None,
          priority=None, time_limit_s=None, preemptible=None):
    """Submit the EVALUATE job of checkpoint `ckpt` (a dict) and record the evaluation.
    Returns the evaluation. Raises BadRequest naming the missing piece."""
    replaced = checkpoints.replaced_sentence(ckpt)
    if replaced:
        raise Conflict(replaced)
    run = runs.get(db, ckpt["run_id"])
    job = jobs.get(db, run["job_id"]) if run["job_id"] else None
    if command is None:
        command = job and job.get("eval_command")
        if not command:
            raise BadRequest(
                f"no evaluation command: give one (`gpuplane ckpt evaluate {ckpt['id']} -- "
                "python eval.py`, or 'command' in the body)"
                + (", or submit the training job with --eval-command" if job else ""))
    if working_dir is None:
        if job is None:
            raise BadRequest(
                f"checkpoint {ckpt['id']} belongs to run {run['id']}, which no job started "
                f"(source {run['source']}); give 'working_dir' (an absolute path on the "
                "agent's host) to evaluate it")
        working_dir = job["working_dir"]
    if not posixpath.isabs(working_dir):
        raise BadRequest(f"'working_dir' must be an absolute path, got {working_dir!r}")
    env = dict(job["env"]) if job else {}
    env.update({"GPUCTL_CHECKPOINT_ID": str(ckpt["id"]),
                "GPUCTL_CHECKPOINT_PATH": ckpt["path"],
                "GPUCTL_CHECKPOINT_STEP": "" if ckpt["step"] is None else str(ckpt["step"])})
    if cpu_only is None and gpus is None:
        gpus, cpu_only = (job["gpus"], job["cpu_only"]) if job else (0, True)
    elif cpu_only:
        gpus = 0
    elif gpus is None:
        gpus = job["gpus"] if job and job["gpus"] else 1
    if isinstance(command, str):
        command = ["/bin/sh", "-c", command]
    spec = {
        "name": f"eval-ckpt{ckpt['id']}", "kind": "EVALUATE", "command": list(command),
        "working_dir": working_dir, "gpus": gpus, "cpu_only": bool(cpu_only or gpus == 0),
        "priority": priority if priority is not None else (job["priority"] if job else 0),
        "max_attempts": job["max_attempts"] if job else 3, "env": env,
        "project": run["project"], "experiment": run["experiment"],
        "tb_dir": None, "watch_dir": None, "parent_checkpoint_id": ckpt["id"],
        "image": job.get("image") if job else None,     # the training job's container too
        # and what it asked of Slurm (docs/slurm.md), but its time: an evaluation is short
        "cpus": job.get("cpus") if job else None,
        "mem_mb": job.get("mem_mb") if job else None,
        "time_limit_s": time_limit_s, "preemptible": preemptible,
    }
    with lifecycle.transaction() as t:
        try:
            new = lifecycle.submit(spec, t)
        except LimitRefused as e:
            raise BadRequest(str(e)) from None
        evaluation_id = checkpoints.add_evaluation(t.conn, ckpt["id"], new["id"],
                                                   spec["command"])
    return checkpoints.get_evaluation(db, evaluation_id)
