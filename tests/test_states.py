"""Job, attempt and run states are defined once (gpuplane/states.py): the modules that
name groups of them take them from there, and every state spelled in a comparison or in
SQL anywhere in the package (or the MCP server) is one of them."""
import pathlib
import re

from gpuplane import states
from gpuplane.api import jobs as api_jobs
from gpuplane.cli import common as cli_common
from gpuplane.db import jobs, runs

ROOT = pathlib.Path(__file__).resolve().parent.parent

# `state = 'QUEUED'`, `state IN ('DISPATCHED', 'RUNNING')`, `["state"] == "RUNNING"`,
# `state not in ("RUNNING", ...)`, `state=states.X` is fine and not matched.
COMPARED = re.compile(r"""state["'\])]*\s*(?:==|!=|=|(?:NOT\s+)?IN\b|(?:not\s+)?in\b)\s*"""
                      r"""(\([^)]*\)|['"][A-Z_]+['"])""")


def spelled_states(text):
    for m in COMPARED.finditer(text):
        yield from re.findall(r"""['"]([A-Z][A-Z_]+)['"]""", m.group(1))


def test_the_groups_come_from_the_one_definition():
    assert jobs.ACTIVE == states.JOB_ACTIVE and jobs.FINAL == states.JOB_FINAL
    assert runs.FINAL_STATES == states.RUN_FINAL
    assert api_jobs.STATES == states.JOB_STATES
    assert tuple(cli_common.JOB_STATES) == states.JOB_STATES
    assert cli_common.FINAL_STATES == set(states.JOB_FINAL)
    assert set(states.JOB_ACTIVE + states.JOB_FINAL) < set(states.JOB_STATES)
    assert set(states.RUN_ACTIVE + states.RUN_FINAL) == set(states.RUN_STATES)


def test_the_check_finds_spelled_states():
    text = """x = "SELECT 1 FROM jobs WHERE state IN ('QUEUED', 'RUNING')"\n""" \
           """if job["state"] == "DONE": pass\nif state != states.QUEUED: pass\n"""
    assert list(spelled_states(text)) == ["QUEUED", "RUNING", "DONE"]


def test_every_state_spelled_in_the_package_is_defined():
    unknown = []
    for path in sorted((ROOT / "gpuplane").rglob("*.py")) + [ROOT / "mcp_server.py"]:
        for name in spelled_states(path.read_text()):
            if name not in states.ALL:
                unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, f"not a state of gpuplane/states.py: {unknown}"
