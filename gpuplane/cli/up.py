"""`gpuplane server`, `gpuplane agent` and `gpuplane up` (a server and a local agent
together, the embedded default for one machine)."""

import argparse
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib

from .common import (EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CliError, command,
                     describe_end, follow_job, note, outcome_code, parents, plural,
                     port_type, positive_int)

# Pretend GPUs `up` gives the local agent on a host without an NVIDIA driver: enough for
# the README's tour (a 1-GPU job) and for a second job to queue beside it.
DEFAULT_FAKE_GPUS = 2


def add_parser(subparsers):
    _, _, home = parents()
    p = command(subparsers, "server", "run the GPUPlane server in the foreground",
                parents=(home,))
    p.add_argument("--host", help="address to listen on (default: server.toml, else 127.0.0.1)")
    p.add_argument("--port", type=port_type, help="port (default: server.toml, else 8600)")
    p.add_argument("--threads", type=positive_int,
                   help="worker threads; each log follower, dashboard stream and agent "
                        "holds one (default: server.toml, else 112)")
    p.set_defaults(func=cmd_server)

    # No options of its own (prefix "+"), so every "--flag" after `agent` reaches the agent.
    p = subparsers.add_parser("agent", add_help=False, prefix_chars="+",
                              help="run the agent (same as gpuplane-agent ARGS)",
                              description="Run the agent on this host: the same as "
                                          "`gpuplane-agent ARGS` or `python agent.py ARGS`.")
    p.add_argument("agent_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the agent, e.g. --server URL --name NODE, with the "
                        "token in $GPUCTL_TOKEN (see `gpuplane agent --help`)")
    p.set_defaults(func=cmd_agent)

    p = command(subparsers, "up", "start a server and a local agent together on this machine",
                parents=(home,))
    p.add_argument("--host", default="127.0.0.1",
                   help="address the server listens on (default 127.0.0.1)")
    p.add_argument("--port", type=port_type,
                   help="server port (default: server.toml, else 8600)")
    p.add_argument("--threads", type=positive_int, help="server worker threads")
    p.add_argument("--fake-gpus", type=positive_int, metavar="N",
                   help="pretend this host has N GPUs (default: the real ones; "
                        f"{DEFAULT_FAKE_GPUS} pretend ones when there is no NVIDIA driver; "
                        "--fake-gpus 0 turns that off)")
    p.add_argument("--name", help="node name of the local agent (default: the hostname)")
    p.add_argument("--example", action="store_true",
                   help="submit the CPU example job from examples/cpu and follow its logs")
    p.add_argument("--exit-when-done", action="store_true",
                   help="with --example: stop everything when the job ends and exit "
                        "with its outcome")
    p.set_defaults(func=cmd_up)


# -- server and agent ------------------------------------------------------------------------


def cmd_server(args):
    from gpuplane import config, server
    server.serve(config.home_dir(args.home), host=args.host, port=args.port,
                 threads=args.threads)
    return EXIT_OK


def repo_root():
    # The package is installed editable or run from a checkout: the repository (with
    # agent.py and examples/) is the parent of the package directory.
    return pathlib.Path(__file__).resolve().parent.parent.parent


def _import_agent():
    try:
        import agent
        return agent
    except ModuleNotFoundError as e:
        if e.name != "agent":
            raise
    path = repo_root() / "agent.py"
    if not path.exists():
        raise CliError("the agent is not installed: no `agent` module and no "
                       f"{path}; install the gpuplane package or run `python agent.py`")
    sys.path.insert(0, str(path.parent))
    import agent
    return agent


def cmd_agent(args):
    agent = _import_agent()
    rest = list(args.agent_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    for flag in ("server", "token", "home"):
        value = getattr(args, flag, None)
        if value and f"--{flag}" not in rest:
            rest = [f"--{flag}", value] + rest
    code = agent.main(rest)
    return code or EXIT_OK


# -- up: the children ------------------------------------------------------------------------


class _Child:
    def __init__(self, name, argv, log_path, env):
        self.name = name
        self.log_path = log_path
        # Private like everything the home holds (the logs may show job commands and
        # paths): created 0600, and an older file made so too.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        self._log = os.fdopen(fd, "ab")
        # Own session: Ctrl-C reaches only `up`, which then stops agent then server in order.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def stop(self, timeout=20):
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                note(f"{self.name} did not stop within {timeout}s; killing it")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()

    def tail(self, n=15):
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines)

    def check(self, while_what=""):
        if not self.alive():
            raise CliError(f"the {self.name} exited (code {self.proc.returncode})"
                           f"{while_what}; its log ({self.log_path}) ends with:\n"
                           f"{self.tail()}")


def _wait_for(what, check, children, deadline_s):
    """Poll check() until it answers; say what is waited for when it takes a while."""
    start = time.monotonic()
    said = False
    while True:
        for child in children:
            child.check(f" while waiting for {what}")
        result = check()
        if result:
            return result
        waited = time.monotonic() - start
        if not said and waited > 2:
            note(f"waiting for {what} (up to {deadline_s}s)...")
            said = True
        if waited > deadline_s:
            raise CliError(f"gave up waiting for {what} after {deadline_s}s; see "
                           + ", ".join(str(c.log_path) for c in children))
        time.sleep(0.2)


class _Terminated(Exception):
    pass


def _sigterm(signum, frame):
    # SIGTERM (a service manager stopping `up`) takes the same clean-stop path as Ctrl-C,
    # but is a normal end: exit 0, where Ctrl-C exits 130.
    raise _Terminated


# -- up: the steps ---------------------------------------------------------------------------


def probe_nvidia():
    """(number of NVIDIA GPUs, None) or (0, why there are none)."""
    try:
        import pynvml
    except ImportError:
        return 0, "the NVML library (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return 0, f"no NVIDIA driver ({type(e).__name__}: {e})"
    try:
        n = pynvml.nvmlDeviceGetCount()
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return (n, None) if n else (0, "the NVIDIA driver reports no GPUs")


def _choose_fake_gpus(args, home):
    """The --fake-gpus to give the agent (None: let it use its agent.toml and NVML), and
    the loud notice to print when pretending."""
    if args.fake_gpus is not None:
        return args.fake_gpus, None
    try:
        with open(home / "agent.toml", "rb") as f:
            if "fake_gpus" in tomllib.load(f):
                return None, None
    except (OSError, tomllib.TOMLDecodeError):
        pass
    n, why = probe_nvidia()
    if n:
        return None, None
    return DEFAULT_FAKE_GPUS, (
        f"NOTE: {why}.\n"
        f"      The local agent pretends this host has {DEFAULT_FAKE_GPUS} GPUs, so jobs "
        "that ask for GPUs (-g N) run, on the CPU.\n"
        "      Turn this off with `--fake-gpus 0` (CPU slots only), or choose the number "
        "with `--fake-gpus N`.")


def _check_args(args):
    if args.exit_when_done and not args.example:
        raise CliError("--exit-when-done only makes sense with --example", EXIT_USAGE)
    example_dir = repo_root() / "examples" / "cpu"
    if args.example and not (example_dir / "train.py").exists():
        raise CliError(f"--example needs {example_dir / 'train.py'}, which is missing; the "
                       "examples come with a checkout of the repository (pip-installed "
                       "copies have none); run `gpuplane up` without --example")
    return example_dir


def _child_env(home):
    env = dict(os.environ)
    env.pop("GPUCTL_SERVER", None)
    env.pop("GPUCTL_TOKEN", None)
    env["GPUCTL_HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(repo_root()), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_server(args, home, port, url, probe, env, children):
    from gpuplane.client import ApiError, ServerUnreachable
    argv = [sys.executable, "-m", "gpuplane", "--home", str(home), "server",
            "--host", args.host, "--port", str(port)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    server = _Child("server", argv, home / "logs" / "server.log", env)
    children.append(server)

    def healthy():
        try:
            return probe.get_health()
        except (ServerUnreachable, ApiError):
            return None

    _wait_for(f"the server to answer at {url}", healthy, children, 60)
    return server


def _start_agent(url, home, name, fake_gpus, agent_token, env, children):
    agent_py = repo_root() / "agent.py"
    argv = [sys.executable, str(agent_py)] if agent_py.exists() \
        else [sys.executable, "-m", "agent"]
    # The token goes in the environment, not argv, where `ps` would show it.
    argv += ["--server", url, "--home", str(home), "--name", name]
    if fake_gpus is not None:
        argv += ["--fake-gpus", str(fake_gpus)]
    agent = _Child("agent", argv, home / "logs" / "agent.log",
                   dict(env, GPUCTL_TOKEN=agent_token))
    children.insert(0, agent)
    return agent


def hint_flags(args, url, home):
    """The flags a user must add to other commands to reach this `up`: --home when it
    is not the default, --server when the home's server.toml does not lead there."""
    from gpuplane.client import local_server
    flags = ["--home", str(home)] if args.home else []
    toml_url, _, _ = local_server(home)
    if (toml_url or "").rstrip("/") != url:
        flags += ["--server", url]
    return (" " + shlex.join(flags)) if flags else ""


def _announce(url, toml_path, node, name, server, agent, hints, token=None):
    gpus = len(node.get("gpus") or [])
    print(f"GPUPlane is up at {url}  (dashboard; REST API under /api/v1/)")
    if token:
        # The fragment never reaches the server; the page stores it and strips it.
        print(f"  open the dashboard: {url}/#token={token}")
    print(f"  admin token: in {toml_path}  (print it: gpuplane{hints} token show-admin)")
    print(f"  node {name}: {plural(gpus, 'GPU')}"
          + (" (fake)" if node.get("fake") else "")
          + f", {node.get('cpu_slots')} CPU slots")
    print(f"  logs: {server.log_path}, {agent.log_path}")
    print(f"  try: gpuplane{hints} status")
    sys.stdout.flush()


def _run_example(client, example_dir, hints):
    # The job runs on this very host, so this interpreter (which has the project's
    # dependencies) is the right `python` for it.
    job = client.submit_job([sys.executable, "train.py", "--epochs", "3"],
                            str(example_dir), name="cpu-example", cpu_only=True,
                            project="examples", experiment="cpu")
    print(f"submitted job {job['id']} (examples/cpu/train.py); its logs:", flush=True)
    final = follow_job(client, job["id"])
    print(describe_end(final))
    print(f"  details: gpuplane{hints} job show {job['id']}", flush=True)
    return outcome_code(final["state"])


def cmd_up(args):
    from gpuplane import config
    from gpuplane import server as server_mod
    from gpuplane.client import ApiError, Client, ServerUnreachable, _connect_url, local_server

    example_dir = _check_args(args)
    home = config.home_dir(args.home)
    cfg = config.load_server_config(home)
    port = args.port or cfg.get("port") or config.DEFAULT_PORT
    url = _connect_url(args.host, port)
    name = args.name or socket.gethostname()

    running = config.running_address(home)
    if running:
        raise CliError(f"a GPUPlane server already runs on the home {home}, at {running}; "
                       "use it (`gpuplane status`), or stop it first")
    try:
        server_mod.check_port(args.host, port, "`gpuplane up --port {port}` (in the "
                              "checkout: `make up PORT={port}`)")
    except server_mod.PortInUse as e:
        try:
            Client(url, "-", timeout=1).get_health()
        except (ServerUnreachable, ApiError):
            raise CliError(str(e)) from None
        raise CliError(f"a GPUPlane server already answers at {url}; use it, stop it, or "
                       "pick another --port") from None
    # Only now that it can start does it write anything to the home.
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    (home / "logs").mkdir(mode=0o700, exist_ok=True)
    os.chmod(home / "logs", 0o700)
    probe = Client(url, "-")
    fake_gpus, fake_notice = _choose_fake_gpus(args, home)
    if fake_notice:
        print(fake_notice, flush=True)

    env = _child_env(home)
    children = []
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        server = _start_server(args, home, port, url, probe, env, children)
        _, admin_token, toml_path = _wait_for(
            f"the admin token in {home / 'server.toml'}",
            lambda: (lambda found: found if found[1] else None)(local_server(home)),
            children, 10)
        client = Client(url, admin_token)
        # The agent gets a token of its own, good only for connecting as this node: a job
        # that reads its agent's environment finds no admin token there.
        agent_token = client.create_token(f"agent {name} (gpuplane up)", "agent",
                                          node=name)["token"]
        agent = _start_agent(url, home, name, fake_gpus, agent_token, env, children)

        def node_connected():
            for node in client.list_nodes():
                if node.get("name") == name and node.get("state") == "connected":
                    return node
            return None

        node = _wait_for(f"node {name!r} (the local agent) to connect", node_connected,
                         children, 60)
        hints = hint_flags(args, url, home)
        _announce(url, toml_path, node, name, server, agent, hints, token=admin_token)
        if args.example:
            code = _run_example(client, example_dir, hints)
            if args.exit_when_done:
                return code
        print("Press Ctrl-C to stop the server and the agent.", flush=True)
        while True:
            for child in children:
                child.check()
            time.sleep(0.5)
    except KeyboardInterrupt:
        note("stopping")
        return EXIT_INTERRUPTED
    except _Terminated:
        note("stopping")
        return EXIT_OK
    finally:
        for child in children:
            child.stop()
        signal.signal(signal.SIGTERM, previous)
