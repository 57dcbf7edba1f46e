"""Nodes (agent hosts): identity, connection state, the outbox cursor, live stats."""
from . import dumps, loads, now_ms


def to_dict(row):
    if row is None:
        return None
    d = dict(row)
    d["gpus"] = loads(d["gpus"], [])
    d["stats"] = loads(d["stats"])
    d["fake"] = bool(d["fake"])
    d["synced"] = bool(d["synced"])
    d["slurm"] = loads(d.get("slurm"))
    return d


def hello(c, msg):
    """Record a (re)connect inside the caller's transaction. Returns the cursor for the
    agent's epoch (0 for a new epoch)."""
    ts = now_ms()
    name = msg["node"]
    row = c.execute("SELECT epoch, cursor FROM nodes WHERE name = ?", (name,)).fetchone()
    cursor = row["cursor"] if row and row["epoch"] == msg["epoch"] else 0
    c.execute(
        "INSERT INTO nodes (name, hostname, version, fake, cpu_slots, gpus, runner, slurm,"
        " state, synced, epoch, cursor, connected_at, last_seen)"
        " VALUES (?,?,?,?,?,?,?,?,'connected',0,?,?,?,?)"
        " ON CONFLICT (name) DO UPDATE SET hostname = excluded.hostname,"
        " version = excluded.version, fake = excluded.fake, cpu_slots = excluded.cpu_slots,"
        " gpus = excluded.gpus, runner = excluded.runner, slurm = excluded.slurm,"
        " state = 'connected', synced = 0, epoch = excluded.epoch,"
        " cursor = excluded.cursor, connected_at = excluded.connected_at,"
        " disconnected_at = NULL, last_seen = excluded.last_seen",
        (name, msg.get("hostname"), msg.get("version"), int(bool(msg.get("fake"))),
         int(msg.get("cpu_slots") or 4), dumps(msg.get("gpus") or []),
         msg.get("runner") or "process",
         dumps(msg["slurm"]) if msg.get("slurm") is not None else None, msg["epoch"],
         cursor, ts, ts))
    return cursor


def cursor(conn, name):
    row = conn.execute("SELECT epoch, cursor FROM nodes WHERE name = ?", (name,)).fetchone()
    return (row["epoch"], row["cursor"]) if row else (None, 0)


def set_cursor(conn, name, seq):
    conn.execute("UPDATE nodes SET cursor = ?, last_seen = ? WHERE name = ?",
                 (seq, now_ms(), name))


def set_stats(conn, name, stats):
    conn.execute("UPDATE nodes SET stats = ? WHERE name = ?", (dumps(stats), name))


def seen(db, name, synced=False):
    """A heartbeat from the node's live connection: it is connected, whatever the row says
    (a server started on the same home, or a crash, may have marked it otherwise)."""
    with db.tx() as c:
        c.execute("UPDATE nodes SET last_seen = ?, state = 'connected', disconnected_at = NULL,"
                  " synced = MAX(synced, ?) WHERE name = ?", (now_ms(), int(synced), name))


def set_synced(conn, name):
    conn.execute("UPDATE nodes SET synced = 1 WHERE name = ? AND state = 'connected'",
                 (name,))


def disconnected(conn, name):
    """Returns whether the node was connected (so this is a change)."""
    return conn.execute(
        "UPDATE nodes SET state = 'disconnected', synced = 0, disconnected_at = ?"
        " WHERE name = ? AND state = 'connected'", (now_ms(), name)).rowcount > 0


def all_disconnected(conn):
    """At server start nobody is connected yet; the grace period starts now. Returns the
    names of the nodes the database still called connected."""
    names = [r[0] for r in conn.execute("SELECT name FROM nodes WHERE state = 'connected'")]
    conn.execute("UPDATE nodes SET state = 'disconnected', synced = 0, disconnected_at = ?"
                 " WHERE state = 'connected' OR disconnected_at IS NULL", (now_ms(),))
    return names


def list_nodes(db):
    return [to_dict(r) for r in db.query("SELECT * FROM nodes ORDER BY name")]


def get(db, name):
    return to_dict(db.query_one("SELECT * FROM nodes WHERE name = ?", (name,)))
