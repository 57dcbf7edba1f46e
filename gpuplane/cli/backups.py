"""`gpuplane backup`, `gpuplane backup list`, `gpuplane restore FILE`: the server's database
(docs/operations.md). They work on the local home's files, not over REST: a backup is safe
while the server runs; a restore needs it stopped."""

from .common import EXIT_OK, CliError, command, parents, print_json, print_table


def add_parser(subparsers):
    _, js, home = parents()
    p = command(subparsers, "backup",
                "an online backup of the server's database into <home>/backups/ "
                "(safe while the server runs and ingests)", parents=(home, js))
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="keep the newest N backups (default: backup_keep in server.toml, 7)")
    p.add_argument("--list", action="store_true", help="list the backups instead")
    p.set_defaults(func=cmd_backup)

    p = command(subparsers, "restore",
                "put a backup in place of the server's database (stop the server first); "
                "the file is checked before anything is replaced", parents=(home, js))
    p.add_argument("file", metavar="FILE", help="a backup, e.g. from `gpuplane backup --list`")
    p.set_defaults(func=cmd_restore)

    p = command(subparsers, "backup-agent",
                "archive this host's agent state (job logs, outbox spool, runtime state) "
                "while jobs run", parents=(home,))
    p.add_argument("-o", "--output", metavar="FILE",
                   help="the archive (default: <home>/backups/agent-<host>-<time>.tar.gz)")
    p.set_defaults(func=cmd_backup_agent)


def _home(args):
    from gpuplane import config
    return config.home_dir(getattr(args, "home", None))


def cmd_backup(args):
    from gpuplane.config import load_server_config
    from gpuplane.db import backup
    home = _home(args)
    if args.list:
        items = backup.list_backups(home)
        if args.json:
            print_json(items)
        elif not items:
            print(f"no backups in {backup.backup_dir(home)} yet; take one with `gpuplane backup`")
        else:
            print_table([[b["path"], f"{b['size_bytes'] / 1e6:.1f} MB"] for b in items],
                        ["FILE", "SIZE"])
        return EXIT_OK
    keep = args.keep if args.keep is not None else int(
        load_server_config(home).get("backup_keep") or 7)
    if keep < 1:
        raise CliError("--keep must be 1 or more")
    try:
        info = backup.take(home, keep=keep)
    except backup.BackupError as e:
        raise CliError(str(e)) from None
    if args.json:
        print_json(info)
    else:
        print(f"backed up {info.get('jobs', 0)} jobs and {info.get('runs', 0)} runs to "
              f"{info['path']} ({info['size_bytes'] / 1e6:.1f} MB, integrity ok); "
              f"keeping the newest {keep}")
    return EXIT_OK


def cmd_restore(args):
    import os

    from gpuplane.db import backup
    from gpuplane.server import AlreadyRunning, lock_home
    home = _home(args)
    # The server holds <home>/server.lock (flock) for its whole life, whatever its --host
    # or --port: a probe of the port in server.toml missed a server started with another
    # one, and the database was replaced under it. The restore holds the lock itself, so
    # no server can start on the home halfway through either.
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = lock_home(home)
    except AlreadyRunning as e:
        raise CliError(f"{e} (it holds {home / 'server.lock'}); stop it first (Ctrl-C on "
                       "`gpuplane up`, or `systemctl --user stop gpuplane-server`); "
                       "nothing was changed") from None
    try:
        info, kept = backup.restore(home, args.file)
    except backup.BackupError as e:
        raise CliError(f"{e}; nothing was changed") from None
    finally:
        os.close(lock)
    if args.json:
        print_json({**info, "previous": kept})
        return EXIT_OK
    print(f"restored {args.file}: {info.get('jobs', 0)} jobs, {info.get('runs', 0)} runs, "
          f"schema version {info['schema_version']}")
    if kept:
        print(f"the database it replaced is kept as {kept}")
    print("start the server again: `gpuplane server` (or `gpuplane up`)")
    return EXIT_OK


def cmd_backup_agent(args):
    # The agent's files are the agent's business: its own code archives them (the agent
    # module ships in this package, and runs alone on hosts without it as agent.py).
    import datetime
    import socket
    import subprocess
    import sys
    home = _home(args)
    out = args.output
    if out is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        (home / "backups").mkdir(mode=0o700, parents=True, exist_ok=True)
        out = str(home / "backups" / f"agent-{socket.gethostname()}-{stamp}.tar.gz")
    r = subprocess.run([sys.executable, "-m", "agent", "backup", out, "--home", str(home)])
    if r.returncode != 0:
        raise CliError("the agent backup failed (its message is above)")
    return EXIT_OK
