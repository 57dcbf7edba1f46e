"""agent.py reads as it is laid out: its docstring's contents are its section headers, its
thread table names every thread it starts, every tunable sits in the settings section,
and the shim's source (the functions SHIM_SOURCE is made of) stands on its own."""
import ast
import builtins
import dis
import os
import re
import subprocess
import sys
import threading

import agent
from agentutil import ROOT

SOURCE = open(os.path.join(ROOT, "agent.py")).read()
RULE = "# " + "-" * 87


def section_headers():
    lines = SOURCE.splitlines()
    return [(i, lines[i + 1][2:]) for i in range(len(lines) - 2)
            if lines[i] == RULE and lines[i + 2] == RULE]


def test_the_docstring_lists_the_section_headers_in_order():
    doc = agent.__doc__
    block = doc.split("Contents (the section headers below, in order):\n\n", 1)[1]
    toc = [ln[4:] for ln in block.split("\n\n", 1)[0].splitlines()]
    assert toc == [title for _i, title in section_headers()]


def _section_of(lineno):
    """The title of the section a (1-based) line is in."""
    title = None
    for i, t in section_headers():
        if i + 1 <= lineno:
            title = t
    return title


# facts, not settings: docker's own exit code for "could not run"
NOT_TUNABLE = {"_DOCKER_ERROR_CODE"}


def _is_number(node):
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    return False


def test_every_tunable_is_in_the_settings_section():
    strays = []
    for node in ast.parse(SOURCE).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name) and _is_number(node.value):
            name = node.targets[0].id
            if name.upper() == name and name not in NOT_TUNABLE:
                if not _section_of(node.lineno).startswith("settings"):
                    strays.append(f"{name} (line {node.lineno})")
    assert not strays, f"move these into the settings section: {strays}"


# Where agent.py starts a thread, and the row of the docstring's table that names it.
THREAD_STARTS = {"Worker.start": "runner (Runner)", "ProcessLauncher.launch": "waiter, one per",
                 "Connection._session": "reader, one per",
                 "SlurmLauncher.warm": "sbatch submitters,"}


def test_the_thread_table_names_every_thread_the_agent_starts():
    tree = ast.parse(SOURCE)
    starts = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and ast.unparse(call.func) == "threading.Thread":
                    starts.add(f"{cls.name}.{fn.name}")
    assert starts == set(THREAD_STARTS), \
        "a thread is started somewhere new: add it to agent.py's thread table and here"
    table = agent.__doc__.split("Threads and processes:", 1)[1]
    for row in THREAD_STARTS.values():
        assert row in table
    workers = sorted(n for n, v in vars(agent).items()
                     if isinstance(v, type) and issubclass(v, agent.Worker) and v is not agent.Worker)
    assert workers == ["Connection", "Runner", "StatsReporter"]
    for name in workers + ["heartbeat, one per", "shim (a process", "main thread"]:
        assert name in table, name


def test_worker_ticks_wakes_and_stops():
    ticks = []
    ticked = threading.Event()

    class Counter(agent.Worker):
        name = "test-counter"
        interval = 3600.0

        def begin(self):
            return 0.0

        def tick(self):
            ticks.append(1)
            ticked.set()
            if len(ticks) == 1:
                raise RuntimeError("a failed tick is logged; the thread carries on")

    w = Counter()
    w.start()
    assert ticked.wait(10)
    ticked.clear()
    w.wake()                 # ends the hour's wait at once
    assert ticked.wait(10)
    w.stop(timeout=10)
    assert not w._thread.is_alive()
    assert len(ticks) == 2


def _global_loads(code):
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield ins.argval
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield from _global_loads(const)


def test_the_shim_source_is_its_functions_and_needs_nothing_else():
    ns = {}
    code = compile(agent.SHIM_SOURCE, "<shim>", "exec")
    exec(code, ns)
    for f in agent.SHIM_FUNCTIONS:
        assert callable(ns.get(f.__name__)), f.__name__
        assert ns[f.__name__].__code__.co_names == f.__code__.co_names, f.__name__
    local_imports = {"select", "socket", "traceback", "psutil"}
    missing = {name for name in _global_loads(code)
               if name not in ns and not hasattr(builtins, name)} - local_imports
    assert not missing, f"the shim uses names it does not define: {missing}; " \
                        "add them to SHIM_FUNCTIONS or SHIM_PRELUDE"
    for argv in (agent.shim_command(), agent.shim_server_command()):
        compile(argv[-1], "<shim>", "exec")


def test_the_shim_runs_without_the_agent_or_site_packages():
    out = subprocess.run([sys.executable, "-I", "-S", "-c",
                          agent.SHIM_SOURCE + "\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=60, env={"PATH": os.defpath},
                         cwd="/")
    assert out.returncode == 0, out.stderr
    modules = set(out.stdout.split())
    assert not modules & {"agent", "inspect", "psutil", "site"}, modules


def test_exit_and_job_records_are_built_in_one_place_each():
    assert list(agent.exit_record()) == ["exit_code", "signal", "ended_at"]
    rec = agent.exit_record(failure_kind="LOST", message="gone")
    assert rec["failure_kind"] == "LOST" and rec["exit_code"] is None
    assert len(re.findall(r'"ended_at": ', SOURCE)) == 1

    class Att:
        job_id, attempt = 3, 1

        def pid(self):
            return {"pid": 42}

    job = agent.Reporter.job_record(Att(), "EXITED", {"exit_code": 1}, "EXIT_CODE", "boom")
    assert tuple(job) == agent.JOB_RECORD_FIELDS
    assert job["pid"] == 42 and job["exit_code"] == 1 and job["signal"] is None


def test_the_architecture_doc_names_every_thread_of_the_agent_and_the_shim():
    doc = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    names = [cls.name for cls in (agent.Runner, agent.StatsReporter, agent.Connection)]
    names += [agent.Connection.name + "-reader", agent.Connection.name + "-heartbeat",
              "gpuplane-agent-wait-", "shim_server", "agent.py _shim DIR"]
    assert [n for n in names if f"`{n}" not in doc] == []


def test_without_its_file_the_agent_says_so():
    r = subprocess.run([sys.executable, "-", "--help"], input=SOURCE, capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert r.returncode != 0 and "run it as `python agent.py`" in r.stderr, r.stderr[-2000:]


# -- the launchers: one interface, one table (issue 34) -----------------------------------

INTERFACE = {"kind", "for_runner", "takes", "exec_spec", "pack", "launch", "adopt", "poll",
             "signal", "limits_time",
             "due", "alive", "enforce_cancel", "classify", "clean", "warm", "close"}


def test_every_launcher_of_the_table_has_the_whole_interface():
    assert list(agent.LAUNCHERS) == ["slurm", "docker", "process"]
    for kind, cls in agent.LAUNCHERS.items():
        missing = {name for name in INTERFACE if not hasattr(cls, name)}
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert cls.kind == kind


def test_the_runner_asks_no_launcher_its_kind():
    """Past its constructor, the runner calls the attempt's launcher, never branches on
    Slurm, Docker or an image itself: a new kind is a class and a row in LAUNCHERS."""
    tree = ast.parse(SOURCE)
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runner")
    strays = []
    for fn in (n for n in runner.body if isinstance(n, ast.FunctionDef)):
        if fn.name == "__init__":
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr in ("slurm", "docker",
                                                                 "container", "image"):
                strays.append(f"Runner.{fn.name}: .{node.attr}")
            if isinstance(node, ast.Constant) and node.value in ("slurm", "docker", "image"):
                strays.append(f"Runner.{fn.name}: {node.value!r}")
    assert not strays, strays


def test_a_start_goes_to_the_first_launcher_that_takes_it(tmp_path):
    from agentutil import Host
    h = Host(tmp_path, thread=False)
    try:
        runner = h.runner
        assert list(runner.launchers) == ["docker", "process"]     # no Slurm here
        assert runner.launcher_for({"image": "busybox"}).kind == "docker"
        assert runner.launcher_for({"command": ["true"]}).kind == "process"
        assert runner.launcher is runner.launchers["process"]
    finally:
        h.stop()
