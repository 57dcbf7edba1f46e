"""The outbox: one ordered, spooled, per-node sequence of records (agent.Outbox).

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import json
import logging
import os


import agent
from agentutil import start_msg, wait_until


def test_outbox_append_recover_and_seq(tmp_path):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    epoch = ob.epoch
    for i in range(5):
        assert ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i + 1, 0, f"l{i}"]]},
                         att={"key": "1/1", "offset": 10 * (i + 1), "line_no": i + 1}) == i + 1
    # a crash: no close(), the spool is all there is beyond the last state.json
    ob2 = agent.Outbox(d)
    assert ob2.epoch == epoch
    assert ob2.next_seq == 6
    assert [s for s, _w in ob2.pending_after(0)] == [1, 2, 3, 4, 5]
    assert ob2.attempt_state("1/1") == {"offset": 50, "line_no": 5}
    wire = json.loads(ob2.pending_after(0)[0][1])
    assert "_att" not in wire and wire["kind"] == "log" and wire["seq"] == 1


def test_outbox_torn_last_line_skipped_with_one_warning(tmp_path, caplog):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    ob.append("node_stats", {"gpus": [], "host": {}})
    ob.append("node_stats", {"gpus": [], "host": {}})
    ob._spool.close()
    with open(os.path.join(d, "spool", "outbox.jsonl"), "ab") as f:
        f.write(b'{"seq":3,"kind":"log","lines":[[1,2,"hal')     # crash mid-write
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        ob2 = agent.Outbox(d)
    torn = [r for r in caplog.records if "torn" in r.getMessage()]
    assert len(torn) == 1
    assert ob2.next_seq == 3
    assert ob2.append("log", {"job_id": 1, "attempt": 1, "lines": []}) == 3
    # the next start reads clean lines only: the torn bytes were not glued to seq 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        ob3 = agent.Outbox(d)
    assert not [r for r in caplog.records if "torn" in r.getMessage()]
    assert [s for s, _w in ob3.pending_after(0)] == [1, 2, 3]


def test_outbox_compaction_keeps_unacked(tmp_path):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d, compact_min=1)
    for i in range(10):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": []},
                  att={"key": "1/1", "offset": i + 1, "line_no": i + 1})
    ob.ack(7)
    with open(os.path.join(d, "spool", "outbox.jsonl")) as f:
        seqs = [json.loads(line)["seq"] for line in f]
    assert seqs == [8, 9, 10]
    state = json.load(open(os.path.join(d, "state.json")))
    assert state["acked"] == 7 and state["next_seq"] == 11
    ob2 = agent.Outbox(d, compact_min=1)
    assert ob2.acked == 7 and ob2.next_seq == 11
    assert [s for s, _w in ob2.pending_after(ob2.acked)] == [8, 9, 10]
    assert ob2.attempt_state("1/1")["offset"] == 10
    ob2.ack(10)
    assert os.path.getsize(os.path.join(d, "spool", "outbox.jsonl")) == 0
    ob3 = agent.Outbox(d)
    assert ob3.next_seq == 11 and ob3.epoch == ob.epoch
    assert ob3.attempt_state("1/1")["line_no"] == 10


def test_outbox_sends_only_what_is_on_disk(tmp_path, monkeypatch):
    """A record goes out only once fsynced, and one fsync covers every record appended
    before it (a group commit): appending never waits on the disk."""
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    synced = []
    real = os.fsync
    monkeypatch.setattr(agent.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    for _ in range(3):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": []})
    assert synced == []
    assert [s for s, _w in ob.pending_after(0)] == [1, 2, 3]
    assert len(synced) == 1
    assert [s for s, _w in ob.pending_after(0)] == [1, 2, 3] and len(synced) == 1
    # one appended between the sync and the batch waits for the next batch
    real_sync = ob.sync
    monkeypatch.setattr(ob, "sync", lambda: (real_sync(), ob.append(
        "log", {"job_id": 1, "attempt": 1, "lines": []})))
    assert [s for s, _w in ob.pending_after(3)] == []
    monkeypatch.setattr(ob, "sync", real_sync)
    assert [s for s, _w in ob.pending_after(3)] == [4]


def test_outbox_new_epoch_only_without_state(tmp_path):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    ob.append("node_stats", {"gpus": [], "host": {}})
    ob.close()
    assert agent.Outbox(d).epoch == ob.epoch
    # state lost but spool kept: a new epoch, the spooled record renumbered from 1
    os.remove(os.path.join(d, "state.json"))
    ob2 = agent.Outbox(d)
    assert ob2.epoch != ob.epoch
    assert [s for s, _w in ob2.pending_after(0)] == [1]
    # a fresh home gets its own epoch
    assert agent.Outbox(str(tmp_path / "other")).epoch not in (ob.epoch, ob2.epoch)


def test_outbox_batches_are_bounded(tmp_path):
    ob = agent.Outbox(str(tmp_path / "agent"))
    for _ in range(600):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[1, 1, "x" * 3000]]})
    first = ob.pending_after(0)
    assert len(first) <= agent.BATCH_MAX_RECORDS
    assert sum(len(w) for _s, w in first) <= agent.BATCH_MAX_BYTES
    assert first[0][0] == 1
    second = ob.pending_after(first[-1][0])
    assert second[0][0] == first[-1][0] + 1


def test_outbox_memory_holds_offsets_not_records(tmp_path):
    ob = agent.Outbox(str(tmp_path / "agent"))
    for i in range(300):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i, 0, "y" * 1000]]},
                  att={"key": "1/1", "offset": i})
    assert not hasattr(ob, "_pending")
    assert len(ob._offs) == 300 and ob.unacked()[299]["lines"][0][0] == 299
    assert "_att" not in ob.unacked()[0]
    ob.ack(100)
    assert [r["seq"] for r in ob.unacked()][:1] == [101]
    ob.close()
    again = agent.Outbox(str(tmp_path / "agent"))
    assert [r["seq"] for r in again.unacked()] == list(range(101, 301))
    assert again.attempt_state("1/1")["offset"] == 299


def test_outbox_reads_new_records_after_emptying_the_spool(tmp_path):
    """An ack of everything (once enough lines are acked: compact_min) truncates the spool
    in place; records appended after it are read back as written (no stale bytes from
    before the truncation)."""
    ob = agent.Outbox(str(tmp_path / "agent"), compact_min=3)
    for i in range(3):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i, 0, "old" * 50]]})
    assert len(ob.pending_after(0, max_records=1)) == 1     # the reader buffers the rest
    ob.ack(3)
    assert os.path.getsize(ob.spool_path) == 0
    ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[9, 0, "new"]]})
    [(seq, wire)] = ob.pending_after(3)
    assert seq == 4 and json.loads(wire)["lines"] == [[9, 0, "new"]]
    ob.close()
    again = agent.Outbox(str(tmp_path / "agent"))
    assert [s for s, _w in again.pending_after(again.acked)] == [4]


def test_acks_below_the_compaction_threshold_leave_the_spool_and_state_alone(tmp_path):
    """An ack does not rewrite state.json nor truncate the spool each time (a file per
    ack, at every job's start and end); the acked lines left in the spool are resent after
    a restart (state.json's `acked` is older), the server skips what its cursor covers,
    and no seq is used twice."""
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d, compact_min=10)
    for i in range(5):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i, 0, "x"]]},
                  att={"key": "1/1", "offset": i + 1, "line_no": i + 1})
    state_before = open(os.path.join(d, "state.json")).read()
    ob.ack(5)
    assert ob.pending_after(5) == []
    assert open(os.path.join(d, "state.json")).read() == state_before
    assert os.path.getsize(ob.spool_path) > 0
    again = agent.Outbox(d, compact_min=10)          # the agent restarts
    assert again.acked == 0 and again.next_seq == 6
    assert [s for s, _w in again.pending_after(again.acked)] == [1, 2, 3, 4, 5]
    assert again.attempt_state("1/1")["offset"] == 5  # folded from the spool's lines
    again.ack(5)                                     # the server's cursor, at hello
    assert again.append("log", {"job_id": 1, "attempt": 1, "lines": []}) == 6
    for _ in range(4):
        again.append("log", {"job_id": 1, "attempt": 1, "lines": []})
    again.ack(10)                                    # 10 acked lines: compacted
    assert os.path.getsize(again.spool_path) == 0
    assert json.loads(open(os.path.join(d, "state.json")).read())["acked"] == 10


def test_state_json_forgets_attempts_once_their_end_is_recorded(tmp_path, hosts):
    """state.json carries the attempts still running, not every attempt since the agent
    started: saving it at each compaction must not grow with the number of jobs run."""
    h = hosts(tmp_path / "home")
    for job_id in range(1, 6):
        h.runner.handle_start(start_msg(job_id, ["true"], tmp_path))
    for job_id in range(1, 6):
        h.wait_exited(job_id)
    wait_until(lambda: all((tmp_path / f"home/agent/jobs/{j}/1/reported").exists()
                           for j in range(1, 6)), what="reported markers")
    h.outbox.ack(h.outbox.last_seq)
    h.outbox.save_state()           # as the next compaction does
    state = json.loads((tmp_path / "home/agent/state.json").read_text())
    assert state["acked"] == h.outbox.last_seq and state["attempts"] == {}


def test_a_cut_spool_does_not_hand_out_seqs_the_server_has_applied(tmp_path):
    """state.json's next_seq is saved only at a compaction, so a spool that lost its tail
    numbers new records from where it now ends. Until a server's cursor has been checked,
    the seqs the outbox vouches for stop at what it loaded: a cursor past them (the
    server applied records the cut took) is outside, and the connection starts a new
    epoch instead of sending new records under seqs the server would skip."""
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    for i in range(5):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i, 0, "x"]]})
    ob.pending_after(0)                  # synced; the server applies 1..5 (and the
    #                                      agent dies: state.json still says next_seq 1)
    with open(ob.spool_path, "rb") as f:
        lines = f.readlines()
    with open(ob.spool_path, "wb") as f:
        f.writelines(lines[:3])          # records 4 and 5 are gone
    again = agent.Outbox(d)
    assert again.next_seq == 4 and again.epoch == ob.epoch     # no gap it could see
    again.append("log", {"job_id": 1, "attempt": 1, "lines": [[9, 0, "new"]]})
    again.append("log", {"job_id": 1, "attempt": 1, "lines": [[10, 0, "new"]]})
    assert again.last_seq == 5 and again.last_held_seq() == 3   # cursor 5: outside
    assert again.accept_cursor(5) == "server cursor 5 outside acked 0..3"
    assert again.accept_cursor(3) is None    # a cursor within it, accepted at hello
    assert again.last_held_seq() == 5


def test_a_held_record_waits_only_while_nothing_else_is_pending(tmp_path):
    ob = agent.Outbox(str(tmp_path / "a"))
    ob.append("job", {"job_id": 1, "attempt": 1, "state": "RUNNING"}, hold_s=30.0)
    items = ob.pending_after(0)
    assert 29.0 < ob.hold(items) <= 30.0         # alone: it may wait for company
    ob.append("log", {"job_id": 1, "attempt": 1, "lines": ["x"]})
    items = ob.pending_after(0)
    assert [json.loads(w)["kind"] for _s, w in items] == ["job", "log"]
    assert ob.hold(items) == 0.0                  # with another record: both go now
    ob.ack(2)
    ob.append("job", {"job_id": 2, "attempt": 1, "state": "RUNNING"}, hold_s=0.05)
    wait_until(lambda: ob.hold(ob.pending_after(2)) == 0.0)     # its time is up
    ob.close()
