"""`gpuplane server`: gunicorn, one gthread worker, many threads, started programmatically."""
import fcntl
import logging
import os
import sys

from gunicorn.app.base import BaseApplication

from . import config as config_mod

log = logging.getLogger("gpuplane")


class _Gunicorn(BaseApplication):
    def __init__(self, home, options, overrides=None):
        self.home = home
        self.options = options
        self.overrides = overrides or {}
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app
        return create_app(self.home, **self.overrides)


def _post_worker_init(worker):
    # gunicorn waits up to graceful_timeout for open requests, and an agent's WebSocket or
    # an SSE follower never ends by itself: on SIGTERM/SIGINT close them first, from a
    # thread (the handler itself only starts it), then let gunicorn's handler run.
    import signal
    import threading

    def wrap(sig):
        previous = signal.getsignal(sig)

        def handler(signum, frame):
            app = getattr(worker, "wsgi", None)
            if app is not None and hasattr(app, "config"):
                from .app import stop_app
                threading.Thread(target=stop_app, args=(app,), daemon=True).start()
            if callable(previous):
                previous(signum, frame)
        signal.signal(sig, handler)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        wrap(sig)


def _worker_exit(server, worker):
    app = getattr(worker, "wsgi", None)
    if app is not None and hasattr(app, "config"):
        from .app import stop_app
        stop_app(app)


def _when_ready(home):
    def hook(arbiter):
        # Bound: say where, for the CLI on this host (server.toml may name another port).
        from .client import _connect_url
        for listener in arbiter.LISTENERS:
            name = listener.getsockname()
            if isinstance(name, tuple):
                config_mod.write_running_address(home, _connect_url(name[0], name[1]))
                return
    return hook


def _on_exit(home):
    def hook(arbiter):
        config_mod.clear_running_address(home)
    return hook


class AlreadyRunning(Exception):
    pass


class PortInUse(Exception):
    pass


def port_holder(host, port):
    """None when (host, port) can be listened on; else who holds it, in words ("pid 412,
    python3", or "another program" when this user may not see which)."""
    import errno
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return None              # gunicorn says what is wrong with the host
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As gunicorn binds: a port left in TIME_WAIT by a stopped server is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        return None
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return None
    finally:
        sock.close()
    try:
        import psutil
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return f"pid {c.pid}, {psutil.Process(c.pid).name()}"
    except Exception:
        pass
    return "another program"


def check_port(host, port, fix):
    """Raise PortInUse with a sentence naming `fix` (the command to start on another
    port) when (host, port) is taken."""
    holder = port_holder(host, port)
    if holder:
        free = next((p for p in range(port + 1, min(port + 50, 65536))
                     if port_holder(host, p) is None), None)
        raise PortInUse(f"port {port} on {host} is in use by {holder}; start on another "
                        "port: " + fix.format(port=free or "N"))


def lock_home(home):
    """Hold an exclusive lock on the home for as long as this process (and the worker it
    forks) lives: a second server on the same home would mark the first one's agents
    disconnected and have their running jobs declared lost."""
    path = home / "server.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = path.read_text().strip() or "?"
        raise AlreadyRunning(f"another GPUPlane server (pid {pid}) is running on the home "
                             f"{home}; stop it first, or give this one another home "
                             "(--home or $GPUCTL_HOME)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def make_private(home):
    """Home directories 0700, files 0600: the database holds job environments (secrets)
    and server.toml the admin token. New files get it from the umask."""
    os.umask(0o077)
    for d in (home, home / "server"):
        if d.is_dir():
            os.chmod(d, 0o700)
    for f in [home / "server.toml", *home.glob("server/gpuctl.db*"), *home.glob("*.log"),
              *home.glob("logs/*")]:
        if f.is_file():
            os.chmod(f, 0o600)
    if (home / "logs").is_dir():
        os.chmod(home / "logs", 0o700)


def serve(home=None, host=None, port=None, threads=None, log_level="info"):
    """Run the server in the foreground until SIGTERM/SIGINT."""
    home = config_mod.home_dir(home)
    os.umask(0o077)
    try:
        home.mkdir(parents=True, exist_ok=True)
        lock = lock_home(home)     # noqa: F841 (held until exit); before touching anything
        # A taken port is said at once, before a first start writes its server.toml.
        found = config_mod.load_server_config(home)
        check_port(host or found["host"], int(port or found["port"]),
                   "`gpuplane server --port {port}` (or `port = {port}` in "
                   f"{home / 'server.toml'})")
        cfg, created = config_mod.ensure_server_config(home, host=host, port=port)
        if threads:
            cfg = cfg.replace(threads=int(threads))
        cfg = config_mod.check_server_config(cfg)
    except (config_mod.ConfigError, AlreadyRunning, PortInUse) as e:
        print(f"gpuplane: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    make_private(home)
    host = host or cfg["host"]
    port = int(port or cfg["port"])
    threads = int(cfg["threads"])
    os.environ["GPUPLANE_HEADER_TIMEOUT_S"] = str(cfg["header_timeout_s"])
    os.environ["GPUPLANE_IO_TIMEOUT_S"] = str(cfg["io_timeout_s"])
    os.environ["GPUPLANE_BODY_TIMEOUT_S"] = str(cfg["body_timeout_s"])
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if created:
        print(f"gpuplane: wrote a new admin token to {home / 'server.toml'}", file=sys.stderr)
    print(f"gpuplane: serving on http://{host}:{port} (home {home}, {threads} threads; "
          f"admin token in {home / 'server.toml'})", file=sys.stderr, flush=True)
    options = {
        "bind": f"{host}:{port}",
        "workers": 1,                 # one process: SQLite writer, in-memory pub/sub
        # gthread, except that request headers are read without holding a pool thread
        "worker_class": "gpuplane.gunicorn_worker.Worker",
        "threads": threads,           # each agent WebSocket / SSE follower holds one
        "timeout": 120,
        "graceful_timeout": 3,        # open streams would otherwise delay shutdown 30 s
        "keepalive": 5,
        "loglevel": log_level,
        "accesslog": None,
        "control_socket_disable": True,  # gunicorn 27 would share $HOME/.gunicorn/*.ctl
        "post_worker_init": _post_worker_init,
        "worker_exit": _worker_exit,
        "when_ready": _when_ready(home),
        "on_exit": _on_exit(home),
    }
    # host and port as really bound, not as server.toml says: the gateway hands jobs
    # GPUCTL_SERVER from them (unless public_url is set, for agents on other hosts).
    _Gunicorn(home, options, {"threads": threads, "host": host, "port": port}).run()
