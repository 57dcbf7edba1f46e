"""REST routes by noun. Each module exposes `bp`, a Blueprint under /api/v1."""
import importlib

MODULES = ("auth", "jobs", "nodes", "runs", "metrics")


def blueprints():
    for name in MODULES:
        yield importlib.import_module(f"{__name__}.{name}").bp
