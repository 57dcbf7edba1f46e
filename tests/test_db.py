"""Database's connections (gpuplane/db/__init__.py): one writer under the write lock, a
fixed pool of readers, and file descriptors that stay where they started however many
threads read at once."""
import os
import sqlite3
import threading

import pytest

from gpuplane import db as dbmod
from gpuplane.db import Database, NestedTransaction


def db_fds(path):
    """This process's descriptors of one database's files (.db, -wal, -shm)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target in (path, path + "-wal", path + "-shm")
    return n


@pytest.fixture
def db(tmp_path):
    d = Database(tmp_path / "d.db", readers=3)
    with d.tx() as c:
        c.execute("CREATE TABLE t (x INTEGER)")
    yield d
    d.close()


def test_many_threads_reading_at_once_open_no_more_descriptors(db):
    # Before: a connection per thread that ever read, and SQLite keeps a closed
    # connection's .db descriptor while any other connection of the process is open, so
    # the count stayed at the largest burst of threads.
    db.query("SELECT 1")
    before = db_fds(db.path)
    inside = threading.Barrier(3)        # as many as there are readers: all in use at once
    errors = []

    def reader(i):
        try:
            with db.read() as conn:
                conn.execute("SELECT count(*) FROM t").fetchone()
                if i < 3:
                    inside.wait(30)
            for _ in range(20):
                db.query("SELECT x FROM t")
        except Exception as e:      # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert db_fds(db.path) == before == (3 + 1) * 2 + 1   # readers + writer: .db, -wal; -shm


def test_a_connection_is_never_lent_to_two_threads_at_once(db):
    holders = {}
    lock = threading.Lock()
    clash = []

    def reader():
        for _ in range(50):
            with db.read() as conn:
                with lock:
                    if id(conn) in holders:
                        clash.append(id(conn))
                    holders[id(conn)] = threading.get_ident()
                conn.execute("SELECT count(*) FROM t").fetchone()
                with lock:
                    del holders[id(conn)]

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert clash == []


def test_a_reader_waits_for_a_free_connection(db, monkeypatch):
    monkeypatch.setattr(dbmod, "CHECKOUT_WAIT_S", 30)
    held = [db._checkout() for _ in range(3)]          # the whole pool
    got = threading.Event()

    def reader():
        db.query("SELECT 1")
        got.set()
    t = threading.Thread(target=reader)
    t.start()
    assert not got.wait(0.2)           # blocked, not given a fourth connection
    db._checkin(held.pop())
    assert got.wait(30)
    t.join(30)
    for c in held:
        db._checkin(c)


def test_an_exhausted_pool_times_out_with_a_sentence(db, monkeypatch):
    monkeypatch.setattr(dbmod, "CHECKOUT_WAIT_S", 0.05)
    held = [db._checkout() for _ in range(3)]
    with pytest.raises(dbmod.PoolTimeout, match="no database connection came free"):
        db.query("SELECT 1")
    for c in held:
        db._checkin(c)
    assert db.query_one("SELECT 1")[0] == 1


def test_reads_inside_a_transaction_see_its_writes_and_use_its_connection(db):
    with db.tx() as c:
        c.execute("INSERT INTO t VALUES (1)")
        assert db.query_one("SELECT count(*) FROM t")[0] == 1
        assert db.conn is c
        with db.read() as r:
            assert r is c
    # another thread does not see an uncommitted write
    seen = []
    with db.tx() as c:
        c.execute("INSERT INTO t VALUES (2)")
        t = threading.Thread(target=lambda: seen.append(db.query_one(
            "SELECT count(*) FROM t")[0]))
        t.start()
        t.join(30)
    assert seen == [1]
    assert db.query_one("SELECT count(*) FROM t")[0] == 2


def test_tx_refuses_nesting_and_works_inside_a_read_block(db):
    with db.tx():
        with pytest.raises(NestedTransaction):
            with db.tx():
                pass
    with db.read() as r:
        with db.tx() as w:
            assert w is not r
            w.execute("INSERT INTO t VALUES (7)")
        assert db.conn is r              # the read block's connection again
        assert r.execute("SELECT count(*) FROM t").fetchone()[0] == 1


def test_conn_outside_a_block_says_what_to_use(db):
    with pytest.raises(RuntimeError, match="with db.read"):
        db.conn


def test_durable_tx_is_full_and_the_next_is_normal_again(db):
    with db.tx(durable=True) as c:
        assert c.execute("PRAGMA synchronous").fetchone()[0] == 2
    with db.tx() as c:
        assert c.execute("PRAGMA synchronous").fetchone()[0] == 1


def test_rows_outlive_the_connection_and_no_old_snapshot_is_lent(db):
    with db.tx() as c:
        c.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(10)])
    rows = db.query("SELECT x FROM t ORDER BY x")
    first = db.query_one("SELECT x FROM t ORDER BY x")      # leaves rows unread
    with db.tx() as c:
        c.execute("DELETE FROM t")
    assert [r["x"] for r in rows] == list(range(10)) and first["x"] == 0
    for _ in range(3):                   # whichever reader comes next sees the delete
        assert db.query_one("SELECT count(*) FROM t")[0] == 0


def test_a_read_that_raises_gives_back_a_fresh_connection(db):
    with pytest.raises(ZeroDivisionError):
        with db.read() as conn:
            cur = conn.execute("SELECT x FROM t")
            cur.fetchone()
            1 / 0
    assert conn not in db._idle and len(db._idle) == 3
    with pytest.raises(sqlite3.OperationalError):
        db.query("SELECT nope FROM t")
    assert len(db._idle) == 3
    assert db.query_one("SELECT 1")[0] == 1


def test_write_failure_is_recorded_and_cleared(db):
    db._writer.execute("PRAGMA query_only = ON")
    with pytest.raises(sqlite3.OperationalError):
        with db.tx() as c:
            c.execute("INSERT INTO t VALUES (1)")
    assert db.write_error
    db._writer.execute("PRAGMA query_only = OFF")
    assert db.probe_write() is None


def test_a_thread_holds_nothing_between_blocks(db):
    def work():
        db.query("SELECT 1")
        with db.tx() as c:
            c.execute("INSERT INTO t VALUES (1)")
        dbmod.close_thread_connections()
    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert len(db._idle) == 3
    assert db.query_one("SELECT count(*) FROM t")[0] == 1


def test_close_closes_every_connection(tmp_path):
    d = Database(tmp_path / "c.db", readers=2)
    d.query("SELECT 1")
    assert db_fds(d.path) == (2 + 1) * 2 + 1
    d.close()
    assert db_fds(d.path) == 0
    with pytest.raises(sqlite3.ProgrammingError):
        d.query("SELECT 1")
    with pytest.raises(sqlite3.ProgrammingError):
        with d.tx():
            pass


def test_a_request_that_finds_no_free_connection_is_a_503(tmp_path, monkeypatch):
    import tomllib
    from gpuplane.app import create_app
    app = create_app(tmp_path / "home", start_threads=False)
    token = tomllib.loads((tmp_path / "home" / "server.toml").read_text())["admin_token"]
    d = app.config["DB"]
    monkeypatch.setattr(dbmod, "CHECKOUT_WAIT_S", 0.05)
    held = [d._checkout() for _ in range(dbmod.READERS)]
    try:
        r = app.test_client().get("/api/v1/status",
                                  headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert "too busy" in r.json["error"]["message"]
    finally:
        for c in held:
            d._checkin(c)
    r = app.test_client().get("/api/v1/status", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200


def test_a_read_past_its_deadline_is_stopped_and_its_reader_comes_back(tmp_path):
    """Issue 22: a request could hold one of the 8 readers for as long as its query ran.
    Now SQLite interrupts a borrowing that runs past read_deadline_s (a 503 at the API)."""
    import sqlite3 as _sqlite3
    from gpuplane.db import Database, PoolTimeout, ReadDeadline
    db = Database(tmp_path / "d.db", readers=2, read_deadline_s=0.2)
    endless = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
               " SELECT count(*) FROM c")
    for _ in range(3):          # more times than there are readers: none is lost
        with pytest.raises(ReadDeadline, match="ran past 0.2 s"):
            db.query_one(endless)
    with pytest.raises(ReadDeadline):
        with db.read() as conn:
            conn.execute(endless).fetchone()
    assert issubclass(ReadDeadline, PoolTimeout) and issubclass(ReadDeadline, _sqlite3.Error)
    assert db.query_one("SELECT 41 + 1")[0] == 42
    with db.tx() as c:          # the writer has no read deadline of its own
        c.execute("CREATE TABLE t (x)")
    db.close()
