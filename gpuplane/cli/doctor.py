"""`gpuplane doctor`: checks the install, one line each, with the fix for each failure."""

import os
import shutil

from .common import EXIT_ERROR, EXIT_OK, command, parents, print_json

LOW_DISK_BYTES = 1 << 30        # under 1 GiB free in the home: logs and the database stall


def add_parser(subparsers):
    conn, js, _ = parents()
    p = command(subparsers, "doctor",
                "check the install: server, token, agents and their GPUs, disk, versions",
                parents=(conn, js))
    p.set_defaults(func=cmd_doctor)


class Report:
    def __init__(self):
        self.lines = []

    def ok(self, what, detail):
        self.lines.append({"ok": True, "check": what, "detail": detail})

    def fail(self, what, detail, fix):
        self.lines.append({"ok": False, "check": what, "detail": detail, "fix": fix})

    def info(self, what, detail):
        self.lines.append({"ok": None, "check": what, "detail": detail})

    @property
    def failed(self):
        return any(line["ok"] is False for line in self.lines)


def run_checks(args):
    from gpuplane import __version__, config
    from gpuplane.client import ApiError, Client, ServerUnreachable
    from .up import probe_nvidia

    r = Report()
    r.info("client", f"gpuplane {__version__}")
    home = config.home_dir(getattr(args, "home", None))
    _check_disk(r, home)
    n, why = probe_nvidia()
    r.info("this host", f"{n} NVIDIA GPU{'s' if n != 1 else ''} (NVML)" if n
           else f"{why}; `gpuplane up` gives its agent pretend GPUs here")

    client = Client(getattr(args, "server", None), getattr(args, "token", None), home)
    try:
        health = client.get_health()
    except (ServerUnreachable, ApiError) as e:
        r.fail("server", f"{client.server}: {e}",
               "start one with `gpuplane up` (or `gpuplane server`), or point at yours "
               "with $GPUCTL_SERVER")
        return r
    server_version = health.get("version")
    if health.get("ok") is False:
        r.fail("server", f"{client.server} answers but cannot write its database "
               f"({health.get('writes')})", "free disk space on the server's host or make "
               "its home writable")
    else:
        r.ok("server", f"{client.server} answers, version {server_version}"
             + ("" if server_version == __version__ else
                f" (this client is {__version__}: upgrade the older one)"))
    if not client.token:
        r.fail("token", "none found", "set $GPUCTL_TOKEN (an admin makes one with `gpuplane "
               "token create`), or run on the server's host, where server.toml has it")
        return r
    try:
        me = client.get_whoami()
    except ApiError as e:
        r.fail("token", e.message, "set $GPUCTL_TOKEN to a valid token (`gpuplane token "
               "create` on the server's host makes one)")
        return r
    access = {"read": "can look, not submit", "write": "can submit and cancel",
              "admin": "can do everything", "agent": "can only connect an agent",
              "ingest": "can only report one run's metrics"}.get(me.get("scope"), "")
    r.ok("token", f"{me.get('name')!r}, scope {me.get('scope')}" + (f": {access}" if access
                                                                     else ""))
    try:
        nodes = client.list_nodes()
    except ApiError as e:
        r.fail("agents", e.message, "use a token with read scope")
        return r
    if not nodes:
        r.fail("agents", "no agent has connected", "start one: `gpuplane up` on this host, "
               "or gpuplane-agent on a GPU host (docs/deploy.md)")
    for node in nodes:
        gpus = len(node.get("gpus") or [])
        kind = "pretend (--fake-gpus)" if node.get("fake") else "NVML"
        text = (f"{node['name']}: {node.get('state')}, {gpus} GPU{'s' if gpus != 1 else ''} "
                f"({kind}), {node.get('cpu_slots')} CPU slots, agent {node.get('version')}")
        if node.get("state") != "connected":
            r.fail(f"agent {node['name']}", text, "start its agent again (`systemctl --user "
                   "start gpuplane-agent`, or `gpuplane up`), or check its log")
        elif node.get("version") and server_version and node.get("version") != server_version:
            r.fail(f"agent {node['name']}", text, f"upgrade the agent to {server_version} "
                   "(copy agent.py from this version)")
        elif node.get("runner") == "slurm":
            _check_slurm_node(r, node)
        elif gpus == 0 and not node.get("fake"):
            r.fail(f"agent {node['name']}", text + "; only CPU jobs can run there",
                   "install the NVIDIA driver, or run the agent with --fake-gpus N to try "
                   "GPU jobs without one")
        else:
            r.ok(f"agent {node['name']}", text)
    return r


def _check_slurm_node(r, node):
    # Its GPUs are the partition's (sinfo at connect), not the login node's (docs/slurm.md).
    offer = node.get("slurm") or {}
    where = f"agent {node['name']}"
    if offer.get("error"):
        r.fail(where, f"{node['name']}: connected, Slurm: sinfo failed: {offer['error']}",
               "check the Slurm client commands on the agent's host (sinfo, sbatch; "
               "SLURM_CONF) and restart the agent")
        return
    r.ok(where, f"{node['name']}: connected, Slurm partition "
         f"{offer.get('partition') or '(default)'}: {offer.get('nodes')} nodes, up to "
         f"{offer.get('max_gpus')} GPUs a node, {node.get('cpu_slots')} jobs at once, "
         f"agent {node.get('version')}")


def _check_disk(r, home):
    probe = home
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError as e:
        r.fail("disk", f"cannot read the disk of {home}: {e}", "check that the home exists")
        return
    free_gib = usage.free / (1 << 30)
    text = f"{free_gib:.1f} GiB free where the home is ({home})"
    if usage.free < LOW_DISK_BYTES:
        r.fail("disk", text, "free space there, or move the home (--home / $GPUCTL_HOME): "
               "the database, logs and spool live in it")
    elif not os.access(probe, os.W_OK):
        r.fail("disk", f"{probe} is not writable", "fix its owner or mode, or use another "
               "--home")
    else:
        r.ok("disk", text)


def cmd_doctor(args):
    r = run_checks(args)
    if args.json:
        print_json({"ok": not r.failed, "checks": r.lines})
        return EXIT_ERROR if r.failed else EXIT_OK
    width = max(len(line["check"]) for line in r.lines)
    for line in r.lines:
        mark = {True: "ok  ", False: "FAIL", None: "    "}[line["ok"]]
        print(f"{mark}  {line['check'].ljust(width)}  {line['detail']}")
        if line["ok"] is False:
            print(f"      {' ' * width}  fix: {line['fix']}")
    return EXIT_ERROR if r.failed else EXIT_OK
