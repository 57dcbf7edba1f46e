"""`gpuplane status` (nodes, slots, the queue) and `gpuplane whoami`."""

from .common import (EXIT_OK, ago, command, duration, make_client, parents, print_json,
                     print_table, wants)


def add_parser(subparsers):
    conn, js, _ = parents()
    p = command(subparsers, "status", "nodes, GPU slots and what runs on them, the queue",
                parents=(conn, js))
    p.add_argument("--url", action="store_true",
                   help="print only the server address the CLI uses (--server, else "
                        "$GPUCTL_SERVER, else the server running on the local home, else "
                        "server.toml's) and exit, without asking it")
    p.set_defaults(func=cmd_status)

    p = command(subparsers, "whoami", "the token in use: name and scope", parents=(conn, js))
    p.set_defaults(func=cmd_whoami)


def cmd_status(args):
    if args.url:
        from gpuplane.client import resolve
        print(resolve(getattr(args, "server", None), getattr(args, "token", None),
                      getattr(args, "home", None))[0])
        return EXIT_OK
    status = make_client(args).get_status()
    if args.json:
        print_json(status)
        return EXIT_OK
    running = {j["id"]: j for j in status.get("running", [])}

    def job_label(job_id):
        j = running.get(job_id)
        return f"job {job_id} {j.get('name') or ''}".rstrip() if j else f"job {job_id}"

    nodes = status.get("nodes", [])
    if not nodes:
        print("no nodes yet; start an agent on a GPU host with a token from "
              "`gpuplane token create --name HOST --agent HOST` (docs/deploy.md)")
    for node in nodes:
        flags = [node.get("state", "?")]
        if node.get("fake"):
            flags.append("fake GPUs")
        seen = ago(node.get("last_seen"))
        if seen and node.get("state") != "connected":
            flags.append(f"last seen {seen}")
        host = node.get("hostname")
        title = node["name"] + (f" ({host})" if host and host != node["name"] else "")
        print(f"{title}  {', '.join(flags)}")
        rows = []
        for g in node.get("gpus", []):
            mem = None
            if g.get("mem_used_mb") is not None and g.get("memory_total_mb"):
                mem = f"{g['mem_used_mb']}/{g['memory_total_mb']} MiB"
            elif g.get("memory_total_mb"):
                mem = f"{g['memory_total_mb']} MiB"
            util = f"{g['util']:.0f}%" if g.get("util") is not None else None
            job = job_label(g["job_id"]) if g.get("job_id") else "free"
            rows.append([f"  GPU {g.get('index')}", g.get("name"), util, mem, job])
        if rows:
            print_table(rows, ["  SLOT", "GPU", "UTIL", "MEMORY", "JOB"])
        cpu_jobs = node.get("cpu_jobs") or []
        slots = node.get("cpu_slots")
        if node.get("runner") == "slurm":
            # its slots are the jobs it may hold in Slurm (docs/slurm.md)
            offer = node.get("slurm") or {}
            used = ", ".join(job_label(j) for j in cpu_jobs) or "none"
            print(f"  Slurm partition {offer.get('partition') or '(default)'}: "
                  + (f"sinfo failed: {offer['error']}" if offer.get("error") else
                     f"{offer.get('nodes')} nodes, up to {offer.get('max_gpus')} GPUs, "
                     f"{offer.get('cpus')} CPUs, {offer.get('mem_mb')} MiB a node, "
                     f"time limit {offer.get('time_limit')}"))
            print(f"  Slurm jobs {len(cpu_jobs)}/{slots}: {used}")
            continue
        if slots is not None or cpu_jobs:
            used = ", ".join(job_label(j) for j in cpu_jobs) or "free"
            print(f"  CPU slots {len(cpu_jobs)}/{slots}: {used}")
    queue = status.get("queue", [])
    print()
    if not queue:
        print("queue: empty")
        return EXIT_OK
    print(f"queue: {len(queue)} job{'s' if len(queue) != 1 else ''}, in the order they "
          "will be considered")
    print_table([[i, j["id"], j.get("name"), j.get("priority"), wants(j),
                  duration(j.get("created_at")), _starts(j),
                  j.get("pending_reason") or "waiting for a slot"]
                 for i, j in enumerate(queue, 1)],
                ["#", "ID", "NAME", "PRIO", "WANTS", "WAITING", "STARTS ~", "REASON"])
    return EXIT_OK


def _starts(job):
    """A queued job's expected start (an estimate, docs/scheduling.md): a clock time,
    "?" where a job it waits for has no limit, blank where none is planned (CPU jobs)."""
    if job.get("expected_start"):
        import time
        return time.strftime("%H:%M:%S", time.localtime(job["expected_start"] / 1000))
    return "?" if not job.get("cpu_only") and job.get("pending_reason") else ""


def cmd_whoami(args):
    client = make_client(args)
    me = client.get_whoami()
    if args.json:
        print_json(me)
        return EXIT_OK
    access = "can write" if me.get("can_write") else "read only"
    extra = f", run {me['run_id']}" if me.get("run_id") else ""
    print(f"{me.get('name')} (scope {me.get('scope')}, {access}{extra}) at {client.server}")
    return EXIT_OK
