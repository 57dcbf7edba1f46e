"""TBTailer: following TensorBoard event files as a training script writes them."""
import json
import logging
import os
import pathlib
import shutil
import struct
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from agent import TBTailer
tb = sys.modules[TBTailer.__module__]     # the module holding it: its knobs and helpers

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.util import tensor_util

FIXTURES = ROOT / "tests" / "data" / "tb"
LOGGER = "gpuplane.agent.tb"


# -- writing event files by hand, with tensorboard's own (independent) CRC code --

def record(data):
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data))


def event(step, wall_time=1700000000.0, **values):
    """An event with one v1 simple_value per keyword (tag=value)."""
    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
    return event_pb2.Event(step=step, wall_time=wall_time, summary=summary).SerializeToString()


def tensor_event(step, tag, tensor, plugin=None, wall_time=1700000000.0):
    v = summary_pb2.Summary.Value(tag=tag, tensor=tensor)
    if plugin:
        v.metadata.plugin_data.plugin_name = plugin
    return event_pb2.Event(step=step, wall_time=wall_time,
                           summary=summary_pb2.Summary(value=[v])).SerializeToString()


FILE_VERSION = event_pb2.Event(wall_time=1700000000.0, file_version="brain.Event:2").SerializeToString()


def new_event_file(d, name="events.out.tfevents.1700000000.host.1.0"):
    os.makedirs(d, exist_ok=True)
    p = os.path.join(d, name)
    with open(p, "wb") as f:
        f.write(record(FILE_VERSION))
    return p


def append(path, data):
    with open(path, "ab") as f:
        f.write(data)


def keyed(points):
    return [(k, s, round(v, 5)) for k, s, v, _ in points]


def loader_points(path, prefix=""):
    """What tensorboard itself reads from a file, in the same shape as TBTailer's points."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    out, plugins = [], {}
    for ev in EventFileLoader(str(path)).Load():
        for v in ev.summary.value:
            if v.HasField("metadata"):    # like TensorBoard: a tag's first metadata holds
                plugins.setdefault(v.tag, v.metadata.plugin_data.plugin_name)
            if plugins.get(v.tag) == "scalars":
                out.append((prefix + v.tag, ev.step, tensor_util.make_ndarray(v.tensor).item(),
                            int(ev.wall_time * 1000)))
    return out


# -- following files as they grow --

def test_growing_file_gives_each_value_once_in_order(tmp_path):
    p = new_event_file(tmp_path)
    t = TBTailer(tmp_path)
    assert t.poll() == []
    got = []
    for step in range(6):
        append(p, record(event(step, wall_time=1700000000.5 + step, loss=step / 4)))
        got += t.poll()
        assert t.poll() == []
    assert got == [("loss", s, s / 4, 1700000000500 + 1000 * s) for s in range(6)]
    assert t.offsets == {os.path.basename(p): os.path.getsize(p)}


def test_written_by_tensorboards_own_v1_writer_while_open(tmp_path):
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    w = EventFileWriter(str(tmp_path))
    t = TBTailer(tmp_path, rescan_s=0)
    got = []
    for step in range(3):
        w.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="acc", simple_value=step + 0.5)])))
        w.flush()
        got += t.poll()
    w.close()
    got += t.poll()
    assert keyed(got) == [("acc", 0, 0.5), ("acc", 1, 1.5), ("acc", 2, 2.5)]


@pytest.mark.parametrize("cut", [1, 8, 11, 12, 13, -5, -4, -1])
def test_partial_record_at_end_is_waited_for(tmp_path, cut):
    p = new_event_file(tmp_path)
    append(p, record(event(0, loss=1.0)))
    whole = record(event(1, loss=2.0))
    append(p, whole[:cut])
    t = TBTailer(tmp_path)
    assert keyed(t.poll()) == [("loss", 0, 1.0)]
    before = t.offsets
    assert t.poll() == []
    assert t.offsets == before == {os.path.basename(p): os.path.getsize(p) - len(whole[:cut])}
    append(p, whole[cut:])
    assert keyed(t.poll()) == [("loss", 1, 2.0)]
    assert t.poll() == []


def test_records_spanning_read_chunks(tmp_path, monkeypatch):
    p = new_event_file(tmp_path)
    append(p, b"".join(record(event(s, loss=s, lr=-s)) for s in range(200)))
    expected = keyed(TBTailer(tmp_path).poll())
    assert len(expected) == 400
    monkeypatch.setattr(tb, "_TB_CHUNK", 37)   # shorter than one record
    assert keyed(TBTailer(tmp_path).poll()) == expected


def test_long_backlog_comes_over_several_polls(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "_TB_CHUNK", 500)
    p = new_event_file(tmp_path / "a")
    append(p, b"".join(record(event(s, loss=s)) for s in range(1000)))
    q = new_event_file(tmp_path / "b")
    append(q, b"".join(record(event(s, acc=s)) for s in range(10)))
    t = TBTailer(tmp_path, max_points=100)
    sizes, got = [], []
    while batch := t.poll():
        sizes.append(len(batch))
        got += keyed(batch)
    assert len(sizes) > 5 and max(sizes) < 130
    assert got == [("a/loss", s, s) for s in range(1000)] + [("b/acc", s, s) for s in range(10)]


def test_new_file_in_subdirectory_mid_run(tmp_path):
    p = new_event_file(tmp_path)
    append(p, record(event(0, loss=1.0)))
    t = TBTailer(tmp_path, rescan_s=0)
    assert keyed(t.poll()) == [("loss", 0, 1.0)]
    q = new_event_file(tmp_path / "validation")
    append(q, record(event(0, loss=3.0)))
    append(p, record(event(1, loss=2.0)))
    assert sorted(keyed(t.poll())) == [("loss", 1, 2.0), ("validation/loss", 0, 3.0)]
    assert set(t.offsets) == {os.path.basename(p), "validation/" + os.path.basename(q)}


def test_per_launch_directories_are_left_out_of_keys():
    assert tb.tb_run_prefix("") == ""
    assert tb.tb_run_prefix("train") == "train/"
    assert tb.tb_run_prefix("logs/validation") == "logs/validation/"
    assert tb.tb_run_prefix("runs/Nov29_08-46-00_gpu-box") == "runs/"        # torch, HF default
    assert tb.tb_run_prefix("Nov29_08-46-00_gpu-box.local_lr0.1") == ""
    assert tb.tb_run_prefix("lightning_logs/version_12") == "lightning_logs/"
    assert tb.tb_run_prefix("version_final") == "version_final/"


def test_files_from_before_the_start_are_ignored(tmp_path):
    old = new_event_file(tmp_path / "old")
    append(old, record(event(0, loss=9.0)))
    os.utime(old, (1000, 1000))
    new = new_event_file(tmp_path / "new")
    append(new, record(event(0, loss=1.0)))
    os.utime(new, (2000, 2000))
    assert keyed(TBTailer(tmp_path, started_after_ts=1500).poll()) == [("new/loss", 0, 1.0)]
    assert len(TBTailer(tmp_path).poll()) == 2


# -- restarts --

def test_restart_with_saved_offsets_neither_repeats_nor_skips(tmp_path):
    p = new_event_file(tmp_path / "train")
    for s in range(3):
        append(p, record(event(s, loss=s)))
    t = TBTailer(tmp_path, started_after_ts=time.time() - 60)
    got = t.poll()
    saved = json.loads(json.dumps(t.offsets))       # what the agent persists

    for s in range(3, 5):
        append(p, record(event(s, loss=s)))
    half = record(event(5, loss=5))
    append(p, half[:10])
    os.utime(p, (1000, 1000))   # even a file that looks older than the restart is resumed
    t2 = TBTailer(tmp_path, started_after_ts=time.time(), offsets=saved)
    got += t2.poll()
    append(p, half[10:])
    got += t2.poll()
    assert keyed(got) == [("train/loss", s, s) for s in range(6)]


def test_offsets_of_files_not_seen_yet_are_kept(tmp_path):
    t = TBTailer(tmp_path, offsets={"gone/events.out.tfevents.1": 123})
    t.poll()
    assert t.offsets == {"gone/events.out.tfevents.1": 123}


def test_file_replaced_by_a_shorter_one_is_read_from_the_start(tmp_path):
    p = new_event_file(tmp_path)
    append(p, b"".join(record(event(s, loss=s)) for s in range(10)))
    t = TBTailer(tmp_path)
    assert len(t.poll()) == 10
    os.remove(p)
    p = new_event_file(tmp_path)
    append(p, record(event(0, loss=7.0)))
    assert keyed(t.poll()) == [("loss", 0, 7.0)]


# -- damaged files --

def corrupt_data(rec, byte=-6):
    b = bytearray(rec)
    b[byte] ^= 0x40           # inside the float value: decodes fine, to a wrong number
    return bytes(b)


def test_bad_data_crc_is_skipped_and_logged_once(tmp_path, caplog):
    p = new_event_file(tmp_path)
    append(p, record(event(0, loss=1.0)) + corrupt_data(record(event(1, loss=2.0)))
           + record(event(2, loss=3.0)) + corrupt_data(record(event(3, loss=4.0)))
           + record(event(4, loss=5.0)))
    t = TBTailer(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = keyed(t.poll()) + keyed(t.poll())
    assert got == [("loss", 0, 1.0), ("loss", 2, 3.0), ("loss", 4, 5.0)]
    assert t.corrupt_records == 2
    assert len([r for r in caplog.records if "data CRC" in r.getMessage()]) == 1


def test_bad_data_crc_at_end_waits_for_the_writer_to_move_on(tmp_path):
    # A record whose bytes are all there but whose CRC fails may be a write still landing.
    p = new_event_file(tmp_path)
    good = record(event(1, loss=2.0))
    append(p, record(event(0, loss=1.0)) + corrupt_data(good))
    t = TBTailer(tmp_path)
    assert keyed(t.poll()) == [("loss", 0, 1.0)]
    assert t.corrupt_records == 0
    with open(p, "r+b") as f:       # the landing write completes
        f.seek(-len(good), os.SEEK_END)
        f.write(good)
    assert keyed(t.poll()) == [("loss", 1, 2.0)]


def test_bad_data_crc_at_end_is_skipped_once_more_follows(tmp_path):
    p = new_event_file(tmp_path)
    append(p, record(event(0, loss=1.0)) + corrupt_data(record(event(1, loss=2.0))))
    t = TBTailer(tmp_path)
    assert keyed(t.poll()) == [("loss", 0, 1.0)]
    append(p, record(event(2, loss=3.0)))
    assert keyed(t.poll()) == [("loss", 2, 3.0)]
    assert t.corrupt_records == 1


def test_bad_length_crc_stops_that_file_only(tmp_path, caplog):
    p = new_event_file(tmp_path / "a")
    rec = bytearray(record(event(1, loss=2.0)))
    rec[9] ^= 0xFF            # the length's CRC
    append(p, record(event(0, loss=1.0)) + bytes(rec) + record(event(2, loss=3.0)))
    q = new_event_file(tmp_path / "b")
    append(q, record(event(0, acc=0.5)))
    t = TBTailer(tmp_path, rescan_s=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = keyed(t.poll())
        append(p, record(event(3, loss=4.0)))
        append(q, record(event(1, acc=0.75)))
        got += keyed(t.poll()) + keyed(t.poll())
    assert sorted(got) == [("a/loss", 0, 1.0), ("b/acc", 0, 0.5), ("b/acc", 1, 0.75)]
    assert len([r for r in caplog.records if "length CRC" in r.getMessage()]) == 1


def test_garbage_file_does_not_crash(tmp_path):
    (tmp_path / "events.out.tfevents.junk").write_bytes(os.urandom(5000))
    (tmp_path / "events.out.tfevents.empty").write_bytes(b"")
    t = TBTailer(tmp_path)
    for _ in range(3):
        assert t.poll() == []


def test_valid_crc_but_not_an_event_is_skipped(tmp_path):
    p = new_event_file(tmp_path)
    append(p, record(b"\xff\xff\xff not a protobuf") + record(event(0, loss=1.0)))
    t = TBTailer(tmp_path)
    assert keyed(t.poll()) == [("loss", 0, 1.0)]
    assert t.corrupt_records == 1


def test_event_with_nan_wall_time_is_skipped(tmp_path):
    p = new_event_file(tmp_path)
    append(p, record(event(0, wall_time=float("nan"), loss=1.0))
           + record(event(1, wall_time=float("inf"), loss=2.0)) + record(event(2, loss=3.0)))
    assert keyed(TBTailer(tmp_path).poll()) == [("loss", 2, 3.0)]


def test_nan_values_are_passed_on(tmp_path):
    # A diverging loss is worth seeing; what to do with it is the protocol's business.
    p = new_event_file(tmp_path)
    append(p, record(event(0, loss=float("nan"))))
    [(key, step, value, _)] = TBTailer(tmp_path).poll()
    assert (key, step) == ("loss", 0) and value != value


def test_oversized_records_are_skipped_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "_TB_HUGE_RECORD", 100)
    p = new_event_file(tmp_path)
    blob = event_pb2.Event(step=0, graph_def=b"g" * 500).SerializeToString()
    append(p, record(blob) + record(event(1, loss=1.0)))
    assert keyed(TBTailer(tmp_path).poll()) == [("loss", 1, 1.0)]


# -- what counts as a scalar --

def test_v2_scalars_from_tensorboards_writer(tmp_path):
    from tensorboard.summary import Writer
    w = Writer(str(tmp_path / "v2"))
    t = TBTailer(tmp_path, rescan_s=0)
    got = []
    for step in range(3):
        w.add_scalar("loss", 1.0 / (step + 1), step=step)
        w.flush()
        got += t.poll()
    w.close()
    assert keyed(got) == [("v2/loss", 0, 1.0), ("v2/loss", 1, 0.5), ("v2/loss", 2, 0.33333)]
    [f] = (tmp_path / "v2").iterdir()
    assert got == loader_points(f, "v2/")


def test_v2_tensor_encodings(tmp_path):
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2
    p = new_event_file(tmp_path)
    # TF2's C++ writer: float32 in tensor_content, plugin metadata with the first value only.
    content = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                                     tensor_content=struct.pack("<f", 0.25))
    append(p, record(tensor_event(0, "epoch_loss", content, plugin="scalars")))
    append(p, record(tensor_event(1, "epoch_loss", content)))
    for step, tag, value in [(0, "f64", 2.5), (0, "i64", 7), (0, "i32", -3), (0, "f16", 1.5)]:
        dtype = {"f64": "float64", "i64": "int64", "i32": "int32", "f16": "float16"}[tag]
        import numpy as np
        proto = tensor_util.make_tensor_proto(np.array(value, dtype=dtype))
        append(p, record(tensor_event(step, tag, proto, plugin="scalars")))
    got = keyed(TBTailer(tmp_path).poll())
    assert got == [("epoch_loss", 0, 0.25), ("epoch_loss", 1, 0.25), ("f64", 0, 2.5),
                   ("i64", 0, 7.0), ("i32", 0, -3.0), ("f16", 0, 1.5)]
    assert [(k, s, round(v, 5)) for k, s, v, _ in loader_points(p)] == got


def test_non_scalar_summaries_are_skipped(tmp_path):
    import numpy as np
    p = new_event_file(tmp_path)
    text = tensor_util.make_tensor_proto(np.array(b"hello", dtype=object))
    histo = tensor_util.make_tensor_proto(np.zeros((4, 3), dtype=np.float64))
    one_bucket = tensor_util.make_tensor_proto(np.zeros((1, 3), dtype=np.float32))
    number = tensor_util.make_tensor_proto(np.array(5.0, dtype=np.float32))
    v1 = summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag="v1_histo", histo=summary_pb2.HistogramProto(min=0, max=1, num=3)),
        summary_pb2.Summary.Value(tag="v1_image", image=summary_pb2.Summary.Image(height=1, width=1)),
        summary_pb2.Summary.Value(tag="loss", simple_value=1.0)])
    append(p, b"".join([
        record(tensor_event(0, "notes", text, plugin="text")),
        record(tensor_event(1, "notes", text)),                        # metadata only came first
        record(tensor_event(0, "weights", histo, plugin="histograms")),
        record(tensor_event(0, "one_bucket", one_bucket, plugin="histograms")),
        record(tensor_event(0, "count", number, plugin="custom_plugin")),  # scalar-shaped, not a scalar
        record(tensor_event(1, "count", number)),
        record(event_pb2.Event(step=0, summary=v1).SerializeToString()),
        record(event_pb2.Event(step=0, graph_def=b"\x0a\x00").SerializeToString()),
    ]))
    assert keyed(TBTailer(tmp_path).poll()) == [("loss", 0, 1.0)]


def test_scalar_tensor_without_metadata_seen_is_read(tmp_path):
    # After a restart mid-file the tag's metadata lies before the saved offset.
    import numpy as np
    p = new_event_file(tmp_path)
    first = record(tensor_event(0, "loss", tensor_util.make_tensor_proto(np.float32(1.0)), plugin="scalars"))
    append(p, first)
    offset = os.path.getsize(p)
    append(p, record(tensor_event(1, "loss", tensor_util.make_tensor_proto(np.float32(2.0)))))
    append(p, record(tensor_event(1, "img", tensor_util.make_tensor_proto(np.array([b"png", b"png"], dtype=object)))))
    append(p, record(tensor_event(1, "weights", tensor_util.make_tensor_proto(np.ones((4, 3))))))
    t = TBTailer(tmp_path, offsets={os.path.basename(p): offset})
    assert keyed(t.poll()) == [("loss", 1, 2.0)]


# -- files from other writers (see tests/data/tb/make_fixtures.py) --

@pytest.mark.parametrize("writer", ["torch", "torch_new_style", "tensorboardx", "tf2"])
def test_fixture_from_other_writers(tmp_path, writer):
    shutil.copytree(FIXTURES / writer, tmp_path / writer)
    got = TBTailer(tmp_path).poll()
    assert sorted(keyed(got)) == sorted(
        [(f"{writer}/loss", s, s / 10) for s in range(5)]
        + [(f"{writer}/train/acc", s, round(s / 10 + 1, 5)) for s in range(5)])
    [f] = (tmp_path / writer).iterdir()
    assert got == loader_points(f, f"{writer}/")


def test_fixture_from_keras_callback(tmp_path):
    shutil.copytree(FIXTURES / "keras", tmp_path / "logs")
    got = TBTailer(tmp_path).poll()
    assert {k for k, *_ in got} == {"logs/train/epoch_loss", "logs/train/epoch_learning_rate",
                                    "logs/validation/epoch_loss",
                                    "logs/validation/evaluation_loss_vs_iterations"}
    assert sorted(s for k, s, *_ in got if k == "logs/validation/epoch_loss") == [0, 1, 2]
    expected = []
    for run in ("train", "validation"):
        [f] = (tmp_path / "logs" / run).iterdir()
        expected += loader_points(f, f"logs/{run}/")
    assert sorted(got) == sorted(expected)


def test_pure_python_crc_fallback_reads_the_same(monkeypatch, tmp_path):
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c
    shutil.copytree(FIXTURES, tmp_path / "tb", ignore=shutil.ignore_patterns("*.py"))
    fast = TBTailer(tmp_path).poll()
    monkeypatch.setattr(tb, "_crc32c", crc32c)
    assert TBTailer(tmp_path).poll() == fast and len(fast) == 52


def test_directory_tree_is_rescanned_only_every_rescan_s(tmp_path):
    t = TBTailer(tmp_path, rescan_s=3600)
    assert t.poll() == []
    append(new_event_file(tmp_path / "late"), record(event(0, loss=1.0)))
    assert t.poll() == []          # growing files are read each poll; the tree is walked rarely
    t._next_scan = 0.0             # as if rescan_s had passed
    assert keyed(t.poll()) == [("late/loss", 0, 1.0)]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_no_file_descriptors_held_between_polls(tmp_path):
    files = [new_event_file(tmp_path / f"run{i}") for i in range(5)]
    t = TBTailer(tmp_path, rescan_s=0)
    t.poll()
    before = len(os.listdir("/proc/self/fd"))
    for step in range(30):
        for p in files:
            append(p, record(event(step, loss=step)))
        assert len(t.poll()) == 5
    assert len(os.listdir("/proc/self/fd")) == before


# -- issue 22: bounded walks, refused roots, one long tag never costs its record --------

def test_the_walk_is_bounded_in_depth_and_entries(tmp_path, monkeypatch, caplog):
    shallow = new_event_file(tmp_path / "a")
    append(shallow, record(event(1, loss=0.5)))
    deep = tmp_path.joinpath(*[f"d{i}" for i in range(tb.TB_MAX_DEPTH + 2)])
    append(new_event_file(deep), record(event(1, deep=0.5)))
    assert {k for k, *_ in TBTailer(tmp_path).poll()} == {"a/loss"}    # too deep: not read
    for i in range(50):
        (tmp_path / "a" / f"junk{i}").write_text("")
    monkeypatch.setattr(tb, "TB_MAX_ENTRIES", 20)
    with caplog.at_level(logging.WARNING):
        TBTailer(tmp_path).poll()
    assert "more than 20 entries" in caplog.text


def test_a_whole_filesystem_home_or_the_agents_home_is_never_walked(tmp_path, monkeypatch):
    assert "whole filesystem" in tb.walk_root_refused("/")
    assert "home directory" in tb.walk_root_refused(os.path.expanduser("~"))
    assert "agent's home" in tb.walk_root_refused(str(tmp_path), agent_home=str(tmp_path))
    assert tb.walk_root_refused(str(tmp_path / "x")) is None


def test_one_long_tag_is_left_out_and_the_rest_of_the_record_sent(tmp_path, caplog):
    class Att:
        job_id, attempt, run_id, key, received_at = 1, 1, 7, "1/1", 0.0
        tb_dir, working_dir = str(tmp_path), str(tmp_path)

        def resolve(self, rel):
            return rel

        class writers:
            @staticmethod
            def owner(*_):
                return tb.OWN
    p = new_event_file(tmp_path / "run")
    for s in range(100):
        append(p, record(event(s, loss=1.0 / (s + 1), **{"t" * 600: 0.5})))
    hook, sent = tb.TensorBoardHook(Att()), []
    with caplog.at_level(logging.WARNING):
        hook.poll(lambda kind, rec, *_: sent.append(rec), final=True)
    keys = {k for rec in sent for k, *_ in rec["points"]}
    assert keys == {"run/loss"} or keys == {"loss"}, keys
    assert sum(len(rec["points"]) for rec in sent) == 100 and hook.refused == 100
    assert "100 TensorBoard points not sent" in caplog.text
