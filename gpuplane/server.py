"""`gpuplane server`: gunicorn, one gthread worker, many threads, started programmatically."""
import logging
import sys

from gunicorn.app.base import BaseApplication

from . import config as config_mod

log = logging.getLogger("gpuplane")


class _Gunicorn(BaseApplication):
    def __init__(self, home, options):
        self.home = home
        self.options = options
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app
        return create_app(self.home)


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


def serve(home=None, host=None, port=None, threads=None, log_level="info"):
    """Run the server in the foreground until SIGTERM/SIGINT."""
    home = config_mod.home_dir(home)
    cfg, created = config_mod.ensure_server_config(home, host=host, port=port)
    host = host or cfg["host"]
    port = int(port or cfg["port"])
    threads = int(threads or cfg["threads"])
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if created:
        print(f"gpuplane: wrote a new admin token to {home / 'server.toml'}", file=sys.stderr)
    print(f"gpuplane: serving on http://{host}:{port} (home {home}, {threads} threads; "
          f"admin token in {home / 'server.toml'})", file=sys.stderr, flush=True)
    options = {
        "bind": f"{host}:{port}",
        "workers": 1,                 # one process: SQLite writer, in-memory pub/sub
        "worker_class": "gthread",
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
    _Gunicorn(home, options).run()
