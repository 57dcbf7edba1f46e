"""The GPU-slot scheduler thread.

Slots are whole GPUs, exclusive, N on one node; never guessed from utilisation. Queued
jobs are considered by priority, then submission order; a job that fits nowhere right
now is skipped so smaller jobs behind it can use free slots, and a job that can never fit
on any known node says so in `pending_reason`. The same tick declares jobs on nodes gone
longer than the grace period NODE_LOST.

State changes go through gpuplane/lifecycle.py (which sends the start command through the
gateway); the scheduler does not know the gateway. `is_connected(node)` (app.py binds the
gateway's) says whether a node's agent holds a connection in this process right now.
"""
import logging

from .db import jobs, nodes, now_ms
from .worker import Worker

log = logging.getLogger(__name__)


class Scheduler(Worker):
    name = "scheduler"

    def __init__(self, db, lifecycle, cfg, is_connected=None):
        super().__init__()
        self.db = db
        self.lifecycle = lifecycle
        self.cfg = cfg
        self.is_connected = is_connected or (lambda node: True)

    def start(self):
        # A new server process holds no agent connection yet, whatever the database says
        # (a crash leaves nodes 'connected'): their grace period starts now, so a node
        # that never comes back still has its jobs declared NODE_LOST.
        self.lifecycle.server_started()
        super().start()

    def tick(self):
        self.expire_lost_nodes()
        self.schedule()

    def expire_lost_nodes(self):
        grace_s = self.cfg.node_grace_s
        cutoff = now_ms() - grace_s * 1000
        for node in nodes.list_nodes(self.db):
            if node["state"] != "disconnected" or (node["disconnected_at"] or 0) > cutoff:
                continue
            self.lifecycle.node_lost(node["name"], grace_s)

    def free_slots(self):
        """{node: (free gpu indices, free cpu slots)} for connected, reconciled nodes."""
        free = {}
        all_nodes = nodes.list_nodes(self.db)
        active = jobs.active(self.db)
        for n in all_nodes:
            if n["state"] != "connected" or not n["synced"] or not self.is_connected(n["name"]):
                continue
            gpus = {g["index"] for g in n["gpus"] if isinstance(g.get("index"), int)}
            cpu = n["cpu_slots"]
            for j in active:
                if j["node"] == n["name"]:
                    gpus -= set(j["gpu_indices"] or [])
                    cpu -= 1 if j["cpu_only"] else 0
            free[n["name"]] = (sorted(gpus), cpu)
        return free, all_nodes

    def schedule(self):
        queue = jobs.placement_queue(self.db)
        if not queue:
            return
        free, all_nodes = self.free_slots()
        for job in queue:
            blocked = self._blocked(job)
            if blocked:
                if blocked != job["pending_reason"]:
                    jobs.set_pending_reason(self.db, job["id"], blocked)
                continue
            node, gpu_indices = self._place(job, free)
            if node is None:
                reason = self._why_waiting(job, all_nodes)
                if reason != job["pending_reason"]:
                    jobs.set_pending_reason(self.db, job["id"], reason)
                continue
            assigned = self.lifecycle.assign(job["id"], node, gpu_indices)
            if assigned is None:
                continue
            gpus_left, cpu_left = free[node]
            free[node] = ([i for i in gpus_left if i not in gpu_indices],
                          cpu_left - (1 if job["cpu_only"] else 0))
            log.info("job %d attempt %d → %s %s", job["id"], assigned["attempt"], node,
                     "cpu" if job["cpu_only"] else f"GPUs {gpu_indices}")

    def _blocked(self, job):
        """Why a queued job may not start whatever the slots: held, or a dependency not
        yet done (a dependency that failed fails the job). None when it may start."""
        if job["held"]:
            return f"held; `gpuplane job release {job['id']}` lets it start"
        if not job["depends_on"]:
            return None
        found = jobs.states(self.db, job["depends_on"])
        waiting = []
        for dep in job["depends_on"]:
            state, name = found.get(dep, ("MISSING", "?"))
            if job["depends_any"]:
                if state not in jobs.FINAL:
                    waiting.append(f"job {dep} ({name}, {state}) to end")
            elif state in ("FAILED", "CANCELLED", "MISSING"):
                self.lifecycle.dependency_failed(
                    job["id"], f"job {dep} ({name}) ended {state}; this job runs only "
                    "after it succeeded (`--after-any` runs after any end)")
                return "dependency failed"
            elif state != "SUCCEEDED":
                waiting.append(f"job {dep} ({name}, {state}) to succeed")
        if waiting:
            return "waiting for " + ", ".join(waiting)
        return None

    @staticmethod
    def _place(job, free):
        if job["cpu_only"]:
            fits = [(cpu, name) for name, (_, cpu) in free.items() if cpu > 0]
            if not fits:
                return None, None
            return max(fits)[1], []
        # Best fit: the node with the fewest free GPUs that still holds the job, so big
        # holes stay open for big jobs.
        fits = sorted((len(g), name) for name, (g, _) in free.items() if len(g) >= job["gpus"])
        if not fits:
            return None, None
        name = fits[0][1]
        return name, free[name][0][:job["gpus"]]

    @staticmethod
    def _why_waiting(job, all_nodes):
        if not all_nodes:
            return ("no agent has connected yet; start one with `gpuplane-agent --server URL` "
                    "and its token in $GPUCTL_TOKEN (docs/deploy.md)")
        if job["cpu_only"]:
            if not any(n["state"] == "connected" for n in all_nodes):
                return "no node is connected"
            return "waiting for a free CPU slot"
        largest = max(all_nodes, key=lambda n: len(n["gpus"]))
        if len(largest["gpus"]) < job["gpus"]:
            return (f"needs {_gpus(job['gpus'])} on one node; the largest node "
                    f"({largest['name']}) has {len(largest['gpus'])}. Lower --gpus or add a "
                    "bigger node")
        if not any(n["state"] == "connected" and len(n["gpus"]) >= job["gpus"]
                   for n in all_nodes):
            return f"no connected node has {_gpus(job['gpus'])}; waiting for one to come back"
        return f"waiting for {_gpus(job['gpus'], 'free ')} on one node"


def _gpus(n, adjective=""):
    return f"{n} {adjective}GPU" + ("" if n == 1 else "s")
