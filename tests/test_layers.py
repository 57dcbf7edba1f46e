"""The lines between modules that a test can hold: SQL only in gpuplane/db/, no import
cycle between the scheduler and the gateway, Worker outside the scheduler."""
import ast
import pathlib
import re

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "gpuplane"

# Statements as this codebase writes them (upper-case keywords), so English prose such
# as "select a token from the list" or an HTTP method name ("DELETE") does not count.
SQL = re.compile(r"\bSELECT\b[\s\S]*\bFROM\b|\bINSERT\s+(?:OR\s+[A-Z]+\s+)?INTO\b"
                 r"|\bUPDATE\s+\w+\s+SET\b|\bDELETE\s+FROM\b|\bREPLACE\s+INTO\b"
                 r"|\bCREATE\s+(?:UNIQUE\s+)?(?:TABLE|INDEX|VIEW|TRIGGER)\b"
                 r"|\bPRAGMA\s+\w+|\bBEGIN\s+(?:IMMEDIATE|EXCLUSIVE|DEFERRED)\b|\bSAVEPOINT\b")


def sql_literals(source):
    """(line, text) of every string literal in `source` that reads as SQL."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if SQL.search(node.value):
                found.append((node.lineno, node.value.strip()[:80]))
    return found


@pytest.mark.parametrize("text", [
    'x = "SELECT id FROM jobs"',
    'x = ("INSERT INTO jobs (a)"\n     " VALUES (?)")',
    'x = f"UPDATE jobs SET state = {s}"',
    'x = "DELETE FROM points WHERE key_id = ?"',
    'x = "CREATE TABLE t (a)"',
    'x = "INSERT OR REPLACE INTO points VALUES (?)"',
])
def test_the_check_finds_sql(text):
    assert sql_literals(text)


@pytest.mark.parametrize("text", [
    'x = "DELETE"', 'x = "select a token from the list"',
    'x = "update the agent, then retry"',
])
def test_the_check_leaves_prose_alone(text):
    assert not sql_literals(text)


def test_no_sql_outside_db():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if (PKG / "db") in path.parents:
            continue
        for line, text in sql_literals(path.read_text()):
            offenders.append(f"{path.relative_to(PKG.parent)}:{line}: {text}")
    assert not offenders, ("SQL belongs in gpuplane/db/ (add a function there and call "
                           "it):\n" + "\n".join(offenders))


def _imports(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names.add(mod.split(".")[-1] if node.level else mod)
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[-1] for a in node.names)
    return names


def test_scheduler_and_gateway_do_not_know_each_other():
    assert "gateway" not in _imports(PKG / "scheduler.py")
    assert "scheduler" not in _imports(PKG / "gateway.py")
    assert "Scheduler" not in (PKG / "gateway.py").read_text()
    assert "Gateway" not in (PKG / "scheduler.py").read_text()


def test_background_threads_do_not_import_the_scheduler_for_worker():
    assert "scheduler" not in _imports(PKG / "rollup.py")
    assert "class Worker" not in (PKG / "scheduler.py").read_text()
