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


class AlreadyRunning(Exception):
    pass


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
        cfg, created = config_mod.ensure_server_config(home, host=host, port=port)
        if threads:
            cfg = cfg.replace(threads=int(threads))
        cfg = config_mod.check_server_config(cfg)
    except (config_mod.ConfigError, AlreadyRunning) as e:
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
    }
    # host and port as really bound, not as server.toml says: the gateway hands jobs
    # GPUCTL_SERVER from them (unless public_url is set, for agents on other hosts).
    _Gunicorn(home, options, {"threads": threads, "host": host, "port": port}).run()
