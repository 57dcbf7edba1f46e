"""The Flask app factory: config, database, background threads, routes, errors."""
import logging
import pathlib

from flask import Flask, send_from_directory

from . import __version__, config as config_mod, errors
from .api import blueprints
from .db import Database, tokens
from .db.metrics import MetricStore

log = logging.getLogger(__name__)
STATIC = pathlib.Path(__file__).resolve().parent.parent / "static"


def create_app(home=None, start_threads=True, **overrides):
    home = config_mod.home_dir(home)
    cfg, created = config_mod.ensure_server_config(home)
    cfg = cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
    cfg = config_mod.check_server_config(cfg)
    if cfg.unknown:
        log.warning("%s: unknown setting(s) %s, ignored; the settings are listed in "
                    "docs/architecture.md (gpuplane/config.py)", cfg.path,
                    ", ".join(cfg.unknown))
    db = Database(home / "server" / "gpuctl.db")
    tokens.create(db, tokens.SERVER_ADMIN, "admin", secret=cfg.admin_token)
    # An admin token that server.toml no longer holds was rotated out: revoke it.
    for name in tokens.revoke_old_admin(db, cfg.admin_token):
        log.warning("revoked %s: server.toml holds another admin token now", name)

    app = Flask(__name__, static_folder=None)
    app.config.update(
        DB=db, GPUPLANE=cfg, HOME=home,
        MAX_CONTENT_LENGTH=cfg.max_body_mb * 1024 * 1024,
        SOCK_SERVER_OPTIONS={"ping_interval": 25, "max_message_size": 8 * 1024 * 1024},
        JSON_SORT_KEYS=False,
    )
    app.json.sort_keys = False
    errors.register(app)

    # The pieces that live as long as the process: pub/sub for logs, the lifecycle (the
    # one writer of job/run/node state), the agent gateway, the scheduler, the event
    # engine and the webhook sender. Imported here so the CLI's import of this module
    # stays light. The lifecycle is wired to the others here; scheduler and gateway never
    # refer to each other.
    from .events import Engine
    from .gateway import Gateway
    from .webhooks import Webhooks
    from .hub import Hub
    from .lifecycle import Lifecycle
    from .rollup import Rollup
    from .scheduler import Scheduler
    hub = Hub()
    lifecycle = Lifecycle(db, publish=hub.publish)
    gateway = Gateway(db, hub, cfg, lifecycle)
    scheduler = Scheduler(db, lifecycle, cfg, is_connected=gateway.connected)
    lifecycle.bind(wake=scheduler.wake, waits=scheduler.waits, agents=gateway)
    rollup = Rollup(db, cfg)
    from .streams import StreamSlots
    slots = StreamSlots(cfg["threads"], cfg["agent_threads"], cfg["rest_threads"])
    engine = Engine(db, cfg)
    gateway.events = engine
    webhooks = Webhooks(db, cfg)
    # lifecycle events (and the engine's own) wake the webhook sender and SSE followers
    lifecycle.on_event(engine.offer_lifecycle)
    # Sweeps launch their trials as jobs end (gpuplane/sweeps.py).
    from .sweeps import Sweeper
    sweeper = Sweeper(db, lifecycle)
    lifecycle.on_event(sweeper.offer_lifecycle)
    # A job with a retention policy prunes its checkpoints when it ends (gpuplane/retention.py).
    from .retention import Retention
    retention = Retention(db, lifecycle, gateway)
    lifecycle.on_event(retention.offer_lifecycle)
    engine.listeners.append(webhooks.notify)
    # A job ends at once on an event its stop_on names (gpuplane/stop_on.py).
    from .stop_on import StopOnEvents
    engine.listeners.append(StopOnEvents(db, lifecycle).notify)
    app.config.update(HUB=hub, GATEWAY=gateway, SCHEDULER=scheduler, ROLLUP=rollup,
                      LIFECYCLE=lifecycle, STREAMS=slots, EVENTS=engine, WEBHOOKS=webhooks,
                      METRICS=MetricStore(db), SWEEPER=sweeper,
                      RETENTION=retention)

    for bp in blueprints():
        app.register_blueprint(bp)
    gateway.register(app)

    @app.get("/")
    def index():
        if (STATIC / "index.html").exists():
            return send_from_directory(STATIC, "index.html")
        return {"name": "gpuplane", "version": __version__, "api": "/api/v1/"}
    index.required_scope = "public"

    @app.get("/static/<path:name>")
    def static_file(name):      # the dashboard's files; its data needs a token
        return send_from_directory(STATIC, name, max_age=0)
    static_file.required_scope = "public"

    threads = [scheduler, rollup, engine, webhooks, sweeper, retention]
    if float(cfg.get("backup_interval_h") or 0) > 0:
        from .backups import BackupSchedule
        threads.append(BackupSchedule(home, cfg["backup_interval_h"], cfg["backup_keep"]))
    if start_threads:
        for t in threads:
            t.start()
    app.config["THREADS"] = threads
    if created:
        log.warning("wrote a new admin token to %s", home / "server.toml")
    return app


def stop_app(app):
    """Close what holds threads open (agent sockets, SSE followers), then stop workers."""
    app.config["HUB"].close()
    app.config["GATEWAY"].close_all()
    for t in app.config.get("THREADS", []):
        t.stop()
