"""API tokens. Only a SHA-256 of each secret is stored."""
import hashlib
import secrets

from . import now_ms

SERVER_ADMIN = "admin (server.toml)"   # the token written to server.toml
SCOPES = ("admin", "write", "read", "agent", "ingest")
PREFIX = {"admin": "gpa_", "write": "gpw_", "read": "gpr_", "agent": "gpg_", "ingest": "gpi_"}


def hash_secret(secret):
    return hashlib.sha256(secret.encode()).hexdigest()


def create(db, name, scope, run_id=None, secret=None, node=None):
    """Store a token in its own transaction; returns (row id, secret). `secret` is given
    for the admin token; `node` binds an agent token to one node name."""
    with db.tx() as conn:
        return add(conn, name, scope, run_id, secret, node)


def add(conn, name, scope, run_id=None, secret=None, node=None):
    """create() inside the caller's transaction."""
    secret = secret or PREFIX[scope] + secrets.token_urlsafe(24)
    conn.execute(
        "INSERT INTO tokens (name, scope, secret_hash, run_id, created_at, node)"
        " VALUES (?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (secret_hash) DO UPDATE SET revoked = 0, scope = excluded.scope,"
        " node = excluded.node",
        (name, scope, hash_secret(secret), run_id, now_ms(), node))
    # lastrowid is not reliable after an upsert that updated: look the id up.
    token_id = conn.execute("SELECT id FROM tokens WHERE secret_hash = ?",
                            (hash_secret(secret),)).fetchone()[0]
    return token_id, secret


def get(db, token_id):
    row = db.query_one("SELECT id, name, scope, run_id, node, created_at, revoked FROM tokens"
                       " WHERE id = ?", (token_id,))
    return dict(row) if row else None


def lookup(db, secret):
    return db.query_one(
        "SELECT id, name, scope, run_id, node FROM tokens WHERE secret_hash = ? AND revoked = 0",
        (hash_secret(secret),))


def list_all(db, include_ingest=False):
    sql = "SELECT id, name, scope, run_id, node, created_at, revoked FROM tokens"
    if not include_ingest:
        sql += " WHERE scope != 'ingest'"
    return [dict(r) for r in db.query(sql + " ORDER BY id")]


def revoke(db, token_id):
    with db.tx() as c:
        return c.execute("UPDATE tokens SET revoked = 1 WHERE id = ?", (token_id,)).rowcount



def revoke_for_run(conn, run_id):
    """The attempt ended: its ingest tokens write no more (inside the caller's tx)."""
    return conn.execute("UPDATE tokens SET revoked = 1 WHERE scope = 'ingest' AND run_id = ?"
                        " AND revoked = 0", (run_id,)).rowcount


def revoke_old_admin(db, current_secret):
    """Revoke every token that came from an earlier server.toml (not the current one).
    Returns their descriptions, for the log."""
    with db.tx() as c:
        rows = c.execute("SELECT id FROM tokens WHERE name = ? AND scope = 'admin'"
                         " AND revoked = 0 AND secret_hash != ?",
                         (SERVER_ADMIN, hash_secret(current_secret))).fetchall()
        c.executemany("UPDATE tokens SET revoked = 1 WHERE id = ?", [(r["id"],) for r in rows])
    return [f"admin token {r['id']} (an earlier server.toml admin_token)" for r in rows]
