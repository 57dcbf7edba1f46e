"""The GPU-slot scheduler thread.

Slots are whole GPUs, exclusive, N on one node; never guessed from utilisation. Queued
jobs are considered by priority, then submission order. The first GPU job that cannot
start now gets a reservation (gpuplane/backfill.py): jobs behind it start only on GPUs the
reservation does not need, or on reserved ones when their time limit ends them before it
("backfill", the default `scheduling`; "strict": none passes it; "first-fit": any job that
fits runs now, the head may starve). A job that can never fit on any known node says so
in `pending_reason`; queued GPU jobs get an `expected_start` (an estimate from the limits).
The same tick declares jobs on nodes gone longer than the grace period NODE_LOST.

State changes go through gpuplane/lifecycle.py (which sends the start command through the
gateway); the scheduler does not know the gateway. `is_connected(node)` (app.py binds the
gateway's) says whether a node's agent holds a connection in this process right now.
"""
import logging
import threading
import time

from . import backfill, states
from .db import jobs, loads, nodes, now_ms
from .worker import Worker

MISSING = "MISSING"      # the state shown for a dependency that is no job
QUEUE_PAGE = 16          # queued jobs read at a time while the nodes are as last seen
PLAN_JOBS = 200          # queued GPU jobs a pass plans for (the head, expected starts)
EXPECT_EVERY_S = 1.0     # expected starts are an estimate: made again at most this often

log = logging.getLogger(__name__)


class Scheduler(Worker):
    name = "scheduler"

    def __init__(self, db, lifecycle, cfg, is_connected=None):
        super().__init__()
        self.db = db
        self.lifecycle = lifecycle
        self.cfg = cfg
        self.is_connected = is_connected or (lambda node: True)
        self._nodes_seen = None     # the nodes as the last pass saw them (schedule)
        self._slurm = set()         # nodes whose agent submits to Slurm (docs/slurm.md)
        self._next_expect = 0.0     # when expected starts may be made again (_expect)
        # the last pass's reservation, for /status: {"job_id", "node", "gpus", "start"}
        self.reservation = None
        # What the last pass left (waits()): the wakes counted when it began, the most free
        # GPUs on one node, whether a CPU slot was free, and the nodes it saw.
        self._lock = threading.Lock()
        self._wakes = 0
        self._left = None

    def start(self):
        # A new server process holds no agent connection yet, whatever the database says
        # (a crash leaves nodes 'connected'): their grace period starts now, so a node
        # that never comes back still has its jobs declared NODE_LOST.
        self.lifecycle.server_started()
        super().start()

    def wake(self):
        """Something may have freed room or queued a job that needs a pass: a job ended, a
        node came, a job was released (lifecycle); count it, then wake the thread."""
        with self._lock:
            self._wakes += 1
        super().wake()

    def waits(self, job):
        """For a job just queued (inside its submit transaction): -> (its pending_reason,
        `moved()`), when a pass would only say why it waits: the last pass left no room it
        fits and nothing has woken the scheduler since (every change that frees room does),
        so the submit need not set off a pass (a drain of short jobs queued faster than
        they run paid one per submit). `moved()`, called after the commit, says whether
        something woke the scheduler meanwhile: the pass it set off may have read the
        queue before this job was in it, so the caller wakes it again. None: wake it."""
        if job["held"] or job["depends_on"]:
            return None
        with self._lock:
            left, wakes = self._left, self._wakes
        if left is None or left[0] != wakes:
            return None
        _, most_gpus, cpu_room, all_nodes = left
        cpu_only = bool(job["cpu_only"])
        if (cpu_room if cpu_only else job["gpus"] <= most_gpus):
            return None
        reason = self._why_waiting({"gpus": job["gpus"], "cpu_only": cpu_only}, all_nodes)

        def moved():
            with self._lock:
                return self._wakes != wakes
        return reason, moved

    def tick(self):
        all_nodes = nodes.list_nodes(self.db)
        if self.expire_lost_nodes(all_nodes):
            all_nodes = nodes.list_nodes(self.db)
        self.schedule(all_nodes)

    def expire_lost_nodes(self, all_nodes=None):
        """-> True when a node was declared lost."""
        grace_s = self.cfg.node_grace_s
        cutoff = now_ms() - grace_s * 1000
        lost = False
        for node in nodes.list_nodes(self.db) if all_nodes is None else all_nodes:
            if node["state"] != "disconnected" or (node["disconnected_at"] or 0) > cutoff:
                continue
            self.lifecycle.node_lost(node["name"], grace_s)
            lost = True
        return lost

    def free_slots(self, all_nodes=None):
        """{node: (free gpu indices, free cpu slots)} for connected, reconciled nodes."""
        free = {}
        all_nodes = nodes.list_nodes(self.db) if all_nodes is None else all_nodes
        in_use = jobs.slots_in_use(self.db)
        self._slurm = {n["name"] for n in all_nodes if n.get("runner") == "slurm"}
        for n in all_nodes:
            if n["state"] != "connected" or not n["synced"] or not self.is_connected(n["name"]):
                continue
            if n["name"] in self._slurm:
                # A Slurm agent's slots are the jobs it may hold in Slurm, of any shape up
                # to the most GPUs one node of its partition has; Slurm picks the cards.
                left = _slurm_slots(n) - sum(1 for node, _, _ in in_use if node == n["name"])
                free[n["name"]] = (list(range(_capacity(n))) if left > 0 else [], max(left, 0))
                continue
            gpus = {g["index"] for g in n["gpus"] if isinstance(g.get("index"), int)}
            cpu = n["cpu_slots"]
            for node, gpu_indices, cpu_only in in_use:
                if node == n["name"]:
                    gpus -= set(gpu_indices)
                    cpu -= 1 if cpu_only else 0
            free[n["name"]] = (sorted(gpus), cpu)
        return free, all_nodes

    def schedule(self, all_nodes=None):
        with self._lock:
            wakes = self._wakes     # what a wake from here on may change, a pass reads again
        free, all_nodes = self.free_slots(all_nodes)
        most_gpus, cpu_room = self._room(free)
        # Why a job waits for a slot depends on its shape and on the nodes: while they
        # look as at the last pass, a job that waits only for a slot, cannot fit now and
        # has its reason keeps it, and the queue is read without those (most of a long
        # queue, at every pass).
        nodes_seen = tuple((n["name"], n["state"], _capacity(n)) for n in all_nodes)
        same = nodes_seen == self._nodes_seen
        reasons = {}        # job id -> a new pending_reason, written at the end in one go
        why = {}            # (gpus, cpu_only) -> why a job of that shape waits
        now = now_ms()
        head = self._head(now, free, all_nodes)
        for job, depends_on, found in self._queue(
                lambda: (most_gpus, cpu_room) if same else None):
            cpu_only = bool(job["cpu_only"])
            behind = (head is not None and not cpu_only
                      and (-job["priority"], job["queued_at"], job["id"]) > head["order"])
            limit_ms = job["time_limit_s"] * 1000 if job["time_limit_s"] else None
            plain = not job["held"] and not depends_on
            # A job that waits only for a slot, of a shape that cannot fit anywhere now,
            # needs no more than its reason: most of a long queue, at every pass.
            if plain and (not cpu_room if cpu_only else job["gpus"] > most_gpus):
                self._say(reasons, job, self._why(why, job, all_nodes))
                continue
            job = {"id": job["id"], "gpus": job["gpus"], "cpu_only": cpu_only,
                   "held": bool(job["held"]), "depends_on": depends_on,
                   "depends_any": bool(job["depends_any"]),
                   "pending_reason": job["pending_reason"]}
            blocked = self._blocked(job, found)
            if blocked:
                self._say(reasons, job, blocked)
                continue
            allowed = self._around(head, limit_ms, free, now) if behind else free
            node, gpu_indices = self._place(job, allowed)
            if node is None:
                if allowed is not free and self._place(job, free)[0] is not None:
                    self._say(reasons, job, self._held_back(head, limit_ms))
                else:
                    self._say(reasons, job, self._why(why, job, all_nodes))
                continue
            slurm = node in self._slurm
            assigned = self.lifecycle.assign(job["id"], node, [] if slurm else gpu_indices)
            if assigned is None:
                continue
            gpus_left, cpu_left = free[node]
            if slurm:
                free[node] = (gpus_left if cpu_left > 1 else [], cpu_left - 1)
            else:
                free[node] = ([i for i in gpus_left if i not in gpu_indices],
                              cpu_left - (1 if job["cpu_only"] else 0))
            most_gpus, cpu_room = self._room(free)
            log.info("job %d attempt %d → %s %s", job["id"], assigned["attempt"], node,
                     "cpu" if job["cpu_only"] else f"GPUs {gpu_indices}")
        if head is not None and head["reason"] != head["pending_reason"]:
            reasons[head["id"]] = head["reason"]
        self.reservation = head and {"job_id": head["id"], "node": head["node"],
                                     "gpus": sorted(head["gpus"]), "start": head["start"]}
        if reasons:
            jobs.set_pending_reasons(self.db, reasons)
        if head is not None or reasons:
            self._expect(all_nodes)
        self._nodes_seen = nodes_seen
        with self._lock:
            self._left = (wakes, most_gpus, cpu_room, all_nodes)

    # -- backfill (gpuplane/backfill.py) --------------------------------------------------

    def _plan_nodes(self, all_nodes):
        """{node: all its GPU indices} of the connected, reconciled nodes the scheduler
        places GPUs on itself (a Slurm agent's cluster plans its own)."""
        return {n["name"]: sorted(g["index"] for g in n["gpus"] if isinstance(g.get("index"), int))
                for n in all_nodes
                if n["state"] == "connected" and n["synced"] and n["name"] not in self._slurm
                and self.is_connected(n["name"])}

    def _head(self, now, free, all_nodes):
        """The reservation of the first GPU job that cannot start now (the queue's jobs
        ahead of it placed as this pass will place them), or None: nothing waits, it fits
        no node, or scheduling is first-fit. {"id", "order", "start" (None: unknown),
        "node", "gpus", "reason", "pending_reason"}."""
        if self.cfg.get("scheduling") == "first-fit":
            return None
        plan = self._plan_nodes(all_nodes)
        if not plan:
            return None
        left = {n: list(free[n][0]) for n in plan if n in free}
        held = [(job_id, node, gpus, end) for job_id, node, gpus, end
                in jobs.running_ends(self.db, now)]
        biggest = max((len(g) for g in plan.values()), default=0)
        for row in self._gpu_queue():
            want = row["gpus"]
            fits = sorted((len(g), n) for n, g in left.items() if len(g) >= want)
            if fits:           # it starts in this pass: what it takes is not free after
                n = fits[0][1]
                taken, left[n] = left[n][:want], left[n][want:]
                end = now + row["time_limit_s"] * 1000 if row["time_limit_s"] else None
                held.append((row["id"], n, taken, end))
                continue
            if want > biggest:
                continue       # it can never fit here; its reason says so
            got = backfill.reservation(now, plan, [h[1:] for h in held], want)
            if got is None:
                continue
            start, node, gpus = got
            if start is None or start > now:
                preempting = self._preempt(now, row, plan, left)
                if preempting:
                    node, ids = preempting
                    return {"id": row["id"], "order": (-row["priority"], row["queued_at"],
                                                       row["id"]),
                            "start": now, "node": node, "gpus": set(plan[node]),
                            "reason": f"preempting {', '.join(f'job {i}' for i in ids)} "
                                      f"(lower priority, preemptible) on node {node}: it "
                                      "starts when they have stopped",
                            "pending_reason": self._pending(row["id"])}
            before = sorted(i for i, n, g, e in held
                            if n == node and set(g) & set(gpus) and (e is None or e > now))
            waits = ", ".join(f"job {i}" for i in before) or "the jobs there"
            keep = [g for g in gpus if g in left.get(node, [])]
            if start is None:
                reason = ((f"holding GPU{'s' if len(keep) != 1 else ''} "
                           f"{','.join(map(str, keep))} of node {node} for it (it needs "
                           f"{want})" if keep else f"next on node {node} (it needs {want})")
                          + f": it starts when {waits} end{'s' if len(before) == 1 else ''}"
                          " (no time limit, so when is unknown)")
            else:
                reason = (f"reserved to start at {_clock(start)} on node {node} (GPU"
                          f"{'s' if len(gpus) != 1 else ''} {','.join(map(str, gpus))}), "
                          f"when {waits} reach{'es' if len(before) == 1 else ''} "
                          f"{'its' if len(before) == 1 else 'their'} time limit")
            return {"id": row["id"], "order": (-row["priority"], row["queued_at"], row["id"]),
                    "start": start, "node": node, "gpus": set(gpus), "reason": reason,
                    "pending_reason": self._pending(row["id"])}
        return None

    def _gpu_queue(self):
        """The queue's first PLAN_JOBS GPU jobs, a page at a time: the head is most often
        in the first page, and a pass should not read 200 rows to find it."""
        for offset in range(0, PLAN_JOBS, QUEUE_PAGE):
            page = jobs.gpu_queue(self.db, QUEUE_PAGE, offset)
            yield from page
            if len(page) < QUEUE_PAGE:
                return

    def _pending(self, job_id):
        return jobs.pending_reason(self.db, job_id)

    def _preempt(self, now, head, plan, left):
        """Priority preemption (docs/scheduling.md): when the head can start only by
        stopping preemptible jobs of lower priority that have run at least
        preempt_min_run_s, stop the fewest of them (then the youngest) on one node.
        -> (node, the ids stopping for it) or None. Jobs already stopping for it are not
        added to: one preemption at a time."""
        already = jobs.being_preempted_for(self.db, head["id"])
        if already:
            node = already[0][1]
            return (node, [i for i, _n in already]) if node in plan else None
        min_run_ms = float(self.cfg.get("preempt_min_run_s") or 0) * 1000
        want = head["gpus"]
        pool = [(i, n, g, started) for i, n, g, prio, started in jobs.preemptible_running(self.db)
                if n in plan and prio < head["priority"] and started
                and now - started >= min_run_ms]
        best = None
        for node, gpus in plan.items():
            if len(gpus) < want:
                continue
            free = len(left.get(node, []))
            mine = sorted((c for c in pool if c[1] == node),
                          key=lambda c: (-len(c[2]), -c[3]))    # fewest, then youngest
            taken, got = [], free
            for c in mine:
                if got >= want:
                    break
                taken.append(c)
                got += len(c[2])
            if got < want or not taken:
                continue
            lost = sum(now - c[3] for c in taken)                # the work a stop costs
            key = (len(taken), lost, node)
            if best is None or key < best[0]:
                best = (key, node, [c[0] for c in taken])
        if best is None:
            return None
        _key, node, ids = best
        for i in ids:
            if self.lifecycle.preempt(i, head["id"]):
                log.info("job %d preempted for job %d on %s", i, head["id"], node)
        return node, ids

    def _around(self, head, limit_ms, free, now):
        """The free slots a job behind the head may take: all but the reserved GPUs, unless
        its limit ends it before the reserved start; none at all under strict."""
        if self.cfg.get("scheduling") == "strict":
            return {n: ([], cpu) for n, (_g, cpu) in free.items()}
        if backfill.may_use_reserved(now, limit_ms, head["start"]):
            return free
        out = dict(free)
        gpus, cpu = free.get(head["node"], ([], 0))
        out[head["node"]] = ([g for g in gpus if g not in head["gpus"]], cpu)
        return out

    def _held_back(self, head, limit_ms):
        if self.cfg.get("scheduling") == "strict":
            return f"waits behind job {head['id']} (scheduling is strict: none passes it)"
        if head["start"] is None:
            return (f"waits behind job {head['id']}, which holds GPUs of node {head['node']} "
                    "until the jobs there end (they have no time limit)")
        return (f"would run past job {head['id']}'s reserved start at "
                f"{_clock(head['start'])} on node {head['node']}"
                + ("" if limit_ms is not None else " (it has no time limit)")
                + "; a --time that ends it before then lets it start now")

    def _expect(self, all_nodes):
        """expected_start of the first PLAN_JOBS queued GPU jobs, after this pass: an
        estimate, made again at most every EXPECT_EVERY_S (a drain wakes the scheduler at
        every job's end)."""
        plan = self._plan_nodes(all_nodes)
        if not plan or time.monotonic() < self._next_expect:
            return
        self._next_expect = time.monotonic() + EXPECT_EVERY_S
        now = now_ms()
        running = [(node, gpus, end) for _id, node, gpus, end in jobs.running_ends(self.db, now)]
        queue = [{"id": r["id"], "gpus": r["gpus"],
                  "limit_ms": r["time_limit_s"] * 1000 if r["time_limit_s"] else None}
                 for r in jobs.gpu_queue(self.db, PLAN_JOBS)]
        if queue:
            jobs.set_expected_starts(self.db, backfill.expected_starts(now, plan, running,
                                                                       queue))

    def _queue(self, room):
        """The queue in placement order: each row with the ids it runs after (decoded once
        for each distinct list: a hundred jobs after one often share it) and the {id:
        (state, name)} of the jobs its page runs after (one read a page, not one a job).
        While the nodes are as the last pass saw them (`room()`: the room left now, else
        None), a page at a time, each read with the room left then: once the free slots
        are filled, the next page holds only the jobs that lack a reason or wait for more
        than a slot, not the rest of a long queue."""
        after, decoded = None, {None: [], "[]": []}
        while True:
            left = room()
            page = (jobs.placement_queue(self.db) if left is None else
                    jobs.placement_queue(self.db, left, after=after, limit=QUEUE_PAGE))
            lists = []
            for row in page:
                text = row["depends_on"]
                if text not in decoded:
                    decoded[text] = loads(text, [])
                lists.append(decoded[text])
            found = jobs.states(self.db, {dep for ids in lists for dep in ids})
            for row, depends_on in zip(page, lists):
                yield row, depends_on, found
            if left is None or len(page) < QUEUE_PAGE:
                return
            last = page[-1]
            after = (last["priority"], last["queued_at"], last["id"])

    @staticmethod
    def _room(free):
        """(most free GPUs on one node, whether any node has a free CPU slot)"""
        return (max((len(g) for g, _ in free.values()), default=0),
                any(cpu > 0 for _, cpu in free.values()))

    @staticmethod
    def _say(reasons, job, reason):
        if reason != job["pending_reason"]:
            reasons[job["id"]] = reason

    def _why(self, cache, job, all_nodes):
        shape = (job["gpus"], bool(job["cpu_only"]))
        if shape not in cache:
            cache[shape] = self._why_waiting({"gpus": shape[0], "cpu_only": shape[1]},
                                             all_nodes)
        return cache[shape]

    def _blocked(self, job, found):
        """Why a queued job may not start whatever the slots: held, or a dependency not
        yet done (a dependency that failed fails the job; `found`: {id: (state, name)}
        of its dependencies, as read with its page). None when it may start."""
        if job["held"]:
            return f"held; `gpuplane job release {job['id']}` lets it start"
        if not job["depends_on"]:
            return None
        waiting = []
        for dep in job["depends_on"]:
            state, name = found.get(dep, (MISSING, "?"))
            if job["depends_any"]:
                if state not in jobs.FINAL:
                    waiting.append(f"job {dep} ({name}, {state}) to end")
            elif state in (states.FAILED, states.CANCELLED, MISSING):
                self.lifecycle.dependency_failed(
                    job["id"], f"job {dep} ({name}) ended {state}; this job runs only "
                    "after it succeeded (`--after-any` runs after any end)")
                return "dependency failed"
            elif state != states.SUCCEEDED:
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
        largest = max(all_nodes, key=_capacity)
        if _capacity(largest) < job["gpus"]:
            return (f"needs {_gpus(job['gpus'])} on one node; the largest node "
                    f"({largest['name']}) has {_capacity(largest)}. Lower --gpus or add a "
                    "bigger node")
        if not any(n["state"] == "connected" and _capacity(n) >= job["gpus"]
                   for n in all_nodes):
            return f"no connected node has {_gpus(job['gpus'])}; waiting for one to come back"
        return f"waiting for {_gpus(job['gpus'], 'free ')} on one node"


def _capacity(node):
    """The most GPUs one job can have on this node: its cards, or for a Slurm agent the
    most one node of its partition offers (sinfo)."""
    if node.get("runner") == "slurm":
        return int((node.get("slurm") or {}).get("max_gpus") or 0)
    return len(node["gpus"])


def _slurm_slots(node):
    return int((node.get("slurm") or {}).get("max_jobs") or node["cpu_slots"] or 0)


def _clock(ms):
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000))


def _gpus(n, adjective=""):
    return f"{n} {adjective}GPU" + ("" if n == 1 else "s")
