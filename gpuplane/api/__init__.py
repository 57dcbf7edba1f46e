"""REST routes by noun. Each module exposes `bp`, a Blueprint under /api/v1."""
import importlib
import importlib.util

MODULES = ("auth", "jobs", "nodes", "runs", "metrics")


def blueprints():
    for name in MODULES:
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            continue        # TEMP while the metrics routes are being written
        yield importlib.import_module(f"{__name__}.{name}").bp
