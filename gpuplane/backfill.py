"""Backfill with one reservation (as Slurm's EASY backfill), and when queued jobs will
start: pure functions of plain data, no SQL, no clock (docs/scheduling.md).

The scheduler (gpuplane/scheduler.py) places queued jobs by priority, then submission
order. The first GPU job that cannot start now but fits a node gets a *reservation*: the
earliest time enough GPUs of one node are free, from the running jobs' time limits, and
which GPUs. A later job may start now on free GPUs the reservation does not need, or on
reserved ones only if its own limit ends it (with a margin) before the reserved start. A
job without a limit therefore never takes a reserved GPU, and the head job is never
starved: nothing it waits for can be extended by a job behind it.

A running job without a limit ends "never" as far as a plan knows: a reservation behind it
has no time (`start` None) and holds the node's free GPUs it needs until it can start.

Times are milliseconds; a node is {name: [gpu indices]}; a running job is (node, [gpu
indices], end or None); a queued job is {"id", "gpus", "limit_ms" (or None)}.
"""
INF = float("inf")
MARGIN_MS = 10_000      # a backfilled job's limit must end this long before the reserved
                        # start: its stop (warning, SIGTERM, the agent's grace) takes time


def free_from(now, nodes, running):
    """{node: {gpu: the time it is free (now, a running job's end, or INF)}}."""
    out = {name: {g: now for g in gpus} for name, gpus in nodes.items()}
    for node, gpus, end in running:
        if node in out:
            for g in gpus:
                if g in out[node]:
                    out[node][g] = INF if end is None else max(now, end)
    return out


def earliest(times, want, now):
    """(start, node, gpus) of the earliest time `want` GPUs of one node are free, given
    {node: {gpu: free from}}; ties go to the node with the fewest GPUs free then (best
    fit). None when no node has that many GPUs."""
    best = None
    for node, gpus in times.items():
        if len(gpus) < want:
            continue
        order = sorted(gpus.items(), key=lambda kv: (kv[1], kv[0]))
        start = max(now, order[want - 1][1])
        picked = sorted(g for g, _ in order[:want])
        free_then = sum(1 for _, t in order if t <= start)
        key = (start, free_then, node)
        if best is None or key < best[0]:
            best = (key, node, picked)
    if best is None:
        return None
    start = best[0][0]
    return (None if start == INF else start), best[1], best[2]


def reservation(now, nodes, running, want):
    """The head job's reservation: (start or None (unknown), node, gpus, ids-free) or
    None when no node could ever hold it."""
    return earliest(free_from(now, nodes, running), want, now)


def may_use_reserved(now, limit_ms, reserved_start):
    """Whether a job with this limit may take GPUs of a reservation that starts then: only
    a limited job that ends (with the margin) before a known start."""
    return (limit_ms is not None and reserved_start is not None
            and now + limit_ms + MARGIN_MS <= reserved_start)


def expected_starts(now, nodes, running, queue, limit=200):
    """{job id: start or None} for the first `limit` GPU jobs of the queue, in its order:
    each placed at the earliest time it fits after the running jobs and those before it
    (list scheduling from their limits: an estimate; None: unknown, a job ahead of it has
    no limit). A job that fits no node is left out."""
    times = free_from(now, nodes, running)
    out = {}
    for job in queue[:limit]:
        got = earliest(times, job["gpus"], now)
        if got is None:
            continue
        start, node, gpus = got
        out[job["id"]] = start
        end = INF if start is None or job.get("limit_ms") is None else start + job["limit_ms"]
        for g in gpus:
            times[node][g] = end
    return out
