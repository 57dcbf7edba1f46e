"""Checkpoint retention (docs/checkpoints.md): which of a job's checkpoints to keep — the
best K by the decisive metric, the last L of each run, every evaluated or pinned one — and
asking the agent that owns the others to delete them. `plan` is a pure function; `prune`
reads the registry, records why each kept one is kept, and sends the deletions (the agent
deletes only registered files inside the job's working dir, never a symlink's target, and
reports each; the gateway marks it deleted with the bytes freed).
"""
import logging
import posixpath
import queue

from . import recommend, states, sweeps
from .db import checkpoints, jobs, loads, projects, sweeps as sweeps_db
from .worker import Worker

log = logging.getLogger(__name__)

MAX_KEEP = 10_000
SETTLE_S = 0.5          # job ends within this of one another are looked at in one tick
AGENT_KEPT = "not deleted by the agent: "     # how the gateway records a refusal


class PolicyError(ValueError):
    """A retention policy that cannot be applied; the message names the fix."""


def parse_policy(data):
    """{"keep_best": K, "keep_last": L} (each 0 .. MAX_KEEP, default 1); one that keeps
    nothing is refused."""
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) - {"keep_best", "keep_last"}:
        raise PolicyError("'retention' is {\"keep_best\": K, \"keep_last\": L}: the best K "
                          "checkpoints by the metric that decides and the last L of each run")
    out = {}
    for name in ("keep_best", "keep_last"):
        v = data.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_KEEP:
            raise PolicyError(f"retention '{name}' must be a whole number from 0 to "
                              f"{MAX_KEEP}, got {v!r}")
        out[name] = v
    if out["keep_best"] == 0 and out["keep_last"] == 0:
        raise PolicyError("this retention policy keeps nothing (keep_best 0, keep_last 0): "
                          "keep at least the best or the last checkpoint (keep_last = 1)")
    return out


def inside(path, working_dir):
    """Whether a registered path lies inside the working dir, by its text (the agent checks
    again with every symlink resolved)."""
    if not path or not working_dir:
        return False
    p, w = posixpath.normpath(path), posixpath.normpath(working_dir)
    return p != w and p.startswith(w.rstrip("/") + "/")


def plan(ckpts, values, d, policy, working_dir, key=None):
    """-> {checkpoint id: (keep, reason)} for the checkpoints not yet deleted. `ckpts`:
    dicts with id, run_id, path, step, pinned, evaluated; `values`: {id: the decisive value
    (an evaluation's, else the training value at the nearest step) or None}."""
    live = [c for c in ckpts if not c.get("deleted_at")]
    out = {}
    for c in live:
        if c.get("replaced_at"):
            # its file holds another run's bytes now: deleting it through this record
            # would delete that run's checkpoint
            out[c["id"]] = (True, "replaced: its file now holds other bytes; never deleted "
                                  "through this record")
        elif c.get("held_elsewhere"):
            out[c["id"]] = (True, f"the same file is run {c['held_elsewhere']}'s live "
                                  "checkpoint: never deleted for this run")
        elif not inside(c["path"], working_dir):
            out[c["id"]] = (True, "outside the job's working dir: never deleted")
        elif c.get("pinned"):
            out[c["id"]] = (True, "pinned")
        elif c.get("evaluated"):
            out[c["id"]] = (True, "evaluated")
        elif (c.get("keep_reason") or "").startswith(AGENT_KEPT):
            out[c["id"]] = (True, c["keep_reason"])     # a symlink, ...: asked once
    sign = 1 if d == "min" else -1
    scored = sorted((c for c in live if isinstance(values.get(c["id"]), (int, float))
                     and values[c["id"]] == values[c["id"]] and d in ("min", "max")),
                    key=lambda c: (sign * values[c["id"]], c["step"] or 0))
    for rank, c in enumerate(scored[:policy["keep_best"]], 1):
        out.setdefault(c["id"], (True, f"best {rank} by {key} ({values[c['id']]:.6g})"))
    by_run = {}
    for c in live:
        by_run.setdefault(c["run_id"], []).append(c)
    for run_id, cs in by_run.items():
        cs.sort(key=lambda c: (c["step"] if c["step"] is not None else -1, c["id"]))
        last = cs[len(cs) - policy["keep_last"]:] if policy["keep_last"] else []
        for i, c in enumerate(reversed(last), 1):
            out.setdefault(c["id"], (True, f"last {i} of run {run_id}"))
    for c in live:
        out.setdefault(c["id"], (False, "not among the best, the last, evaluated or pinned"))
    return out


def policy_of(db, job):
    """The job's own policy, else its experiment's, else None."""
    if job.get("retention"):
        return job["retention"]
    if job.get("experiment"):
        return projects.experiment_retention(db, job["project"], job["experiment"])
    return None


def metric_of(db, job):
    """(key, direction) that decides for a job: its sweep's, else the experiment's primary."""
    if job.get("sweep_id"):
        sweep = sweeps_db.get(db, job["sweep_id"])
        if sweep:
            key, d, _ = sweeps.resolve_metric(db, sweep["spec"], sweep["project"],
                                              sweep["experiment"])
            if key:
                return key, d
    key, d, _ = recommend.resolve_metric(db, None, job["project"], job["experiment"])
    return key, d


def ranked_with(db, job):
    """The jobs whose checkpoints one policy ranks together: for a sweep's trial, every
    trial of the sweep that has ended and shares its working dir (the best K are the
    sweep's best, not each trial's), with the job itself; else the job alone. A trial
    still running keeps its checkpoints until it ends and its own pass ranks them."""
    if not job.get("sweep_id"):
        return [job]
    out = [job]
    for t in sweeps_db.trials(db, job["sweep_id"]):
        if t.get("job_id") in (None, job["id"]) or t.get("job_state") not in states.JOB_FINAL:
            continue
        other = jobs.get(db, t["job_id"])
        if other and other["working_dir"] == job["working_dir"]:
            out.append(other)
    return out


def prune(db, lifecycle, gateway, job, policy=None, dry_run=False):
    """Apply a policy (the job's own when None) to the job's checkpoints (a trial's with
    its sweep's ended trials', ranked_with). Returns what is kept and why, what goes
    (and, unless dry_run, was sent to its agent)."""
    policy = policy or policy_of(db, job)
    if not policy:
        raise PolicyError(f"job {job['id']} has no retention policy (nor has its "
                          "experiment); give keep_best / keep_last")
    ckpts = [c for j in ranked_with(db, job) for c in checkpoints.of_job_runs(db, j["id"])]
    key, d = metric_of(db, job)
    if policy["keep_best"] and (not key or d not in ("min", "max")):
        # the best cannot be told: keeping "the best K" would quietly keep none of them
        raise PolicyError(
            f"no metric decides which of job {job['id']}'s checkpoints are best: give its "
            "experiment a primary metric with a direction (`gpuplane metric set KEY "
            "--direction min|max --primary`), or keep_best 0 to keep only the last L")
    values = {}
    if key:
        for run_id in {c["run_id"] for c in ckpts}:
            for c in checkpoints.candidates(db, key, run_id=run_id):
                values[c["id"]] = c["evaluation"] if c["evaluation"] is not None \
                    else c["training"]
    decided = plan(ckpts, values, d, policy, job["working_dir"], key)
    by_id = {c["id"]: c for c in ckpts}
    keep = [{"checkpoint_id": i, "path": by_id[i]["path"], "step": by_id[i]["step"],
             "reason": why} for i, (k, why) in decided.items() if k]
    drop = [{"checkpoint_id": i, "run_id": by_id[i]["run_id"], "path": by_id[i]["path"],
             "step": by_id[i]["step"], "size_bytes": by_id[i]["size_bytes"],
             "node": by_id[i]["node"]} for i, (k, _) in decided.items() if not k]
    sent = {}
    if not dry_run:
        with lifecycle.transaction() as t:
            checkpoints.set_keep_reasons(t.conn, {c["checkpoint_id"]: c["reason"]
                                                  for c in keep})
            t.publish = True
        for node in sorted({c["node"] for c in drop if c["node"]}):
            files = [{"checkpoint_id": c["checkpoint_id"], "run_id": c["run_id"],
                      "path": c["path"]} for c in drop if c["node"] == node]
            sent[node] = bool(gateway and gateway.delete_checkpoints(
                node, job["id"], job["working_dir"], files))
    return {"job_id": job["id"], "policy": policy, "metric": {"key": key, "direction": d},
            "dry_run": dry_run, "keep": keep, "delete": drop,
            "bytes": sum(c["size_bytes"] or 0 for c in drop), "sent": sent}


class Retention(Worker):
    """Applies a job's retention policy when it ends (lifecycle events hand it the job)."""
    name = "retention"
    interval = 5.0

    def __init__(self, db, lifecycle, gateway):
        super().__init__()
        self.db, self.lifecycle, self.gateway = db, lifecycle, gateway
        self._todo = queue.SimpleQueue()

    def offer_lifecycle(self, event):
        if event.get("job_id") is not None and event["type"] in states.JOB_FINAL:
            self._todo.put(event["job_id"])
            self.wake()

    def settle_s(self):
        return SETTLE_S

    def tick(self):
        ids = set()
        while True:
            try:
                ids.add(self._todo.get_nowait())
            except queue.Empty:
                break
        for job_id in self._with_policy(sorted(ids)):
            job = jobs.get(self.db, job_id)
            if not job:
                continue
            try:
                r = prune(self.db, self.lifecycle, self.gateway, job)
                log.info("job %d retention: %d kept, %d to delete", job_id,
                         len(r["keep"]), len(r["delete"]))
            except PolicyError as e:
                log.warning("job %d: retention not applied, nothing deleted: %s", job_id, e)
            except Exception:
                log.exception("job %d: retention failed", job_id)

    def _with_policy(self, ids):
        """The jobs of `ids` that have a retention policy (policy_of), read with only what
        that needs: most jobs have none, and a drain of short jobs read each whole job as
        it ended."""
        policies = {}           # (retention, project, experiment) -> policy_of()
        for job_id, *key in jobs.retention_keys(self.db, ids):
            key = tuple(key)
            if key not in policies:
                stored, project, experiment = key
                policies[key] = policy_of(self.db, {
                    "retention": loads(stored), "project": project, "experiment": experiment})
            if policies[key]:
                yield job_id
