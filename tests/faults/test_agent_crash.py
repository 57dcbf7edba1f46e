"""The agent is SIGKILLed at random moments while a job logs, and once its spool is cut at
a random byte. The job never notices; every line arrives once.

The cut comes while the server is down for a moment, so the spool holds unsent records
(the agent compacts it to nothing within milliseconds of each ack otherwise).
Honest about the cut: a spool record the server already applied (seq <= the node's
cursor) costs nothing when cut off. A record above the cursor that is cut off may be lost
for good: the agent's state.json can already hold the tail offset past it, so nothing
re-reads those lines. The test computes exactly those "at risk" lines from the spool and
the cursor at the moment of the cut; every other line must arrive exactly once, and a line
at risk may be missing but never doubled. Most come back anyway (re-tailed from the job's
log file when state.json did not cover them yet); the report says how many.
"""
import json
import os
import random
import time


from .helpers import check_lines, log_rows, node_cursor, report, starts, stream_command, wait_for

SEEDS = [int(s) for s in os.environ.get("FAULTS_SEEDS", "21,22").split(",")]
LONG_SEEDS = [21, 22, 23, 24, 25, 26]
TORN = "skipping a torn last line"


def _cut_spool(path, rng, cursor):
    """Truncate the spool at a random byte. Returns (bytes before, cut at, torn?, the
    line numbers of log records above the cursor that the cut removed)."""
    data = path.read_bytes() if path.exists() else b""
    at = rng.randint(0, len(data)) if data else 0
    at_risk, pos = set(), 0
    for raw in data.split(b"\n"):
        end = pos + len(raw)
        if raw and end >= at:               # cut off, wholly or partly (a torn line)
            rec = json.loads(raw)
            if rec["seq"] > cursor and rec["kind"] == "log":
                at_risk.update(int(t.split()[1]) for _no, _ts, t in rec["lines"]
                               if t.startswith("line "))
        pos = end + 1
    # torn: the cut leaves part of a line; a cut just before a line's newline leaves the
    # whole record (it still parses), so nothing is skipped and nothing warned
    torn = 0 < at < len(data) and data[at - 1:at] != b"\n" and data[at:at + 1] != b"\n"
    with open(path, "r+b") as f:
        f.truncate(at)
    return len(data), at, torn, at_risk


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        from .helpers import long_mode
        metafunc.parametrize("seed", LONG_SEEDS if long_mode(metafunc.config) else SEEDS)


def test_agent_sigkill_and_a_cut_spool(seed, server_factory, agent_factory, tmp_path):
    rng = random.Random(seed)
    lines, duration, kills_planned = 4_000, 8.0, 3
    server = server_factory({"log_keep_lines": 10_000_000})
    agent = agent_factory(server, name="crashy", fake_gpus=1)
    spool = agent.home / "agent" / "spool" / "outbox.jsonl"
    job = server.api.submit(stream_command(tmp_path, lines, duration=duration), tmp_path,
                            gpus=1)
    wait_for(lambda: starts(tmp_path), 30, what="the job started")

    cut_at_kill = rng.randrange(kills_planned)
    cut = None
    for k in range(kills_planned):
        time.sleep(rng.uniform(0.1, duration / 4))      # a random moment
        if k == cut_at_kill:
            # The agent acks and compacts within milliseconds, so a spool worth cutting
            # needs a server that does not answer for a moment: the outbox piles up.
            server.kill()
            wait_for(lambda: spool.stat().st_size > 4000, 20, what="a spool to cut")
        agent.kill()
        if k == cut_at_kill:
            server.start()
            epoch, cursor = node_cursor(server, "crashy")
            state = json.loads((agent.home / "agent" / "state.json").read_text())
            # records of another epoch are not covered by this cursor: treat all as unacked
            cut = _cut_spool(spool, rng, cursor if state["epoch"] == epoch else 0)
        agent.start()

    j = server.api.wait_job(job["id"], timeout=120)
    rows = log_rows(server, job["id"])
    stored, lost, doubled, disorder, gaps = check_lines(rows, lines)
    texts = {int(t.split()[1]) for _a, _n, t in rows if t.startswith("line ")}
    size, at, torn, at_risk = cut
    missing = set(range(lines)) - texts
    warnings = agent.log_path.read_text().count(TORN)
    report("agent-crash", seed=seed, kills=kills_planned, spool_bytes=size, cut_at=at,
           torn=torn, torn_warnings=warnings, lines_sent=lines, lines_stored=stored,
           lines_doubled=doubled, lines_at_risk=len(at_risk), lines_lost=lost,
           recovered=len(at_risk - missing), job=j["state"], exit_code=j["exit_code"],
           starts=len(starts(tmp_path)))

    assert j["state"] == "SUCCEEDED" and j["exit_code"] == 0 and j["attempt"] == 1, j
    assert len(starts(tmp_path)) == 1 and (tmp_path / "ends").exists(), "job interrupted"
    assert doubled == 0 and disorder == 0
    assert missing <= at_risk, f"lost lines that were not at risk: {sorted(missing - at_risk)[:20]}"
    assert warnings == (1 if torn else 0)
