"""REST routes by noun. Each module exposes `bp`, a Blueprint under /api/v1."""
import importlib

from flask import current_app

MODULES = ("auth", "jobs", "nodes", "runs", "metrics", "events", "semantic", "stream", "routes",
           "checkpoints", "projects", "sweeps")


def blueprints():
    for name in MODULES:
        yield importlib.import_module(f"{__name__}.{name}").bp


def current_db():
    """The app's Database (gpuplane.db), for the route modules."""
    return current_app.config["DB"]


def current_lifecycle():
    """The app's Lifecycle (gpuplane.lifecycle): every job/run state change goes there."""
    return current_app.config["LIFECYCLE"]
