"""The `gpuplane` command (also installed as `gpuctl`).

Top-level imports are the standard library only: argparse-manpage imports this module
to build the man page in an environment that may not have the project's dependencies.
Everything else is imported by the command that needs it.

Exit codes (docs/cli.md):
  0  success; with --follow / logs -f / up --exit-when-done: the job SUCCEEDED
  1  the server refused the request (its message says why) or another error
  2  usage: bad arguments
  3  the followed job ended CANCELLED
  4  cannot reach the server
  5  the followed job ended FAILED
  6  job wait --until-event: a critical event came first
  130 interrupted (Ctrl-C)
"""

import argparse
import difflib
import os
import re
import sys

from . import (backups, checkpoints, common, completion, doctor, events, jobs, runs, semantic, status,
               sweeps, tokens, up)
from .common import (EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE,
                     CliError, note)
# re-exported: gpuplane.cli's exit codes and formatting helpers (tests use them)
from .common import EXIT_CANCELLED, EXIT_FAILED, ago, duration, print_table  # noqa: F401

# One line per module of commands, in the order `gpuplane --help` lists them. A new
# command: a module with add_parser(subparsers) (see gpuplane/cli/status.py), one line here.
COMMANDS = [
    up,         # server, agent, up
    jobs,       # job ..., logs
    status,     # status, whoami
    tokens,     # token ...
    runs,       # run ...
    semantic,   # diagnose, explain
    checkpoints,  # ckpt ..., project ..., exp ..., metric ..., import-run
    sweeps,     # sweep ...
    backups,    # backup, restore
    events,     # events, event-hook
    doctor,     # doctor
    completion,  # completion bash|zsh
]

EXIT_CODES_EPILOG = """\
exit codes:
  0   success (a followed job SUCCEEDED)
  1   the server refused the request, or another error (message on stderr)
  2   bad arguments
  3   a followed job ended CANCELLED
  4   cannot reach the server
  5   a followed job ended FAILED
  6   `job wait --until-event`: a critical event was filed first
  124 `job wait --timeout S` passed before the jobs ended
  130 interrupted"""


class Parser(argparse.ArgumentParser):
    """argparse, with a hint where a usage error has a usual cause."""

    argv = argv_seen = None

    def error(self, message):
        argv = self.argv if self.argv is not None else sys.argv[1:]
        if message.startswith("unrecognized arguments") and "submit" in argv \
                and "--" not in argv:
            message += ("\nhint: put `--` before the job's command, so that its options "
                        "are its own: gpuplane job submit [options] -- python train.py "
                        "--epochs 3")
        # `job sumbit`: argparse lists the choices; say which one was meant
        m = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f"\ndid you mean: {self.prog} {close[0]}"
        super().error(message)


def _prog():
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "gpuctl" if name == "gpuctl" else "gpuplane"


def get_parser():
    """The whole `gpuplane` parser (also what the man page and completion are made from)."""
    parser = Parser(
        prog=_prog(),
        description="GPUPlane: a job queue, live logs and metrics for your own GPU "
                    "machines. Also installed as `gpuctl`.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_global_options(parser, suppress=False)
    from gpuplane import __version__      # a constant: no dependency is imported
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=Parser)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


# -- main -----------------------------------------------------------------------------------


def server_main(argv=None):
    """`gpuctl-server ARGS`: `gpuplane server ARGS` under the seed's name."""
    return main(["server", *(sys.argv[1:] if argv is None else argv)])


def main(argv=None):
    parser = get_parser()
    Parser.argv = Parser.argv_seen = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    finally:
        Parser.argv = None
    if getattr(args, "token", None) and any(a == "--token" or a.startswith("--token=")
                                            for a in Parser.argv_seen):
        note("warning: a token on the command line is visible to every user of this host "
             "(`ps`); put it in $GPUCTL_TOKEN instead")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `gpuplane logs 3 | head`: the reader left; say nothing.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except Exception as e:
        return _report(e, args)


def _report(exc, args):
    from gpuplane.client import ApiError, BadServerAddress, ServerUnreachable
    if isinstance(exc, CliError):
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    if isinstance(exc, BadServerAddress):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, ServerUnreachable):
        print(f"error: {exc}; is it running? Start one with `gpuplane server` (or "
              "`gpuplane up`), or point at another with --server URL / $GPUCTL_SERVER",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if isinstance(exc, ApiError):
        message = exc.message
        if exc.status == 401 and not _has_token(args):
            # Instead of the server's sentence: this side knows why none was sent.
            message = ("the server wants a token and none was found: set $GPUCTL_TOKEN "
                       "(an admin makes one with `gpuplane token create`), or run on the "
                       "server's host, where the admin token is read from server.toml")
        print(f"error: {message}", file=sys.stderr)
        return EXIT_ERROR
    try:
        from gpuplane.config import ConfigError
        config_errors: tuple = (ConfigError,)
    except ImportError:
        config_errors = ()
    if isinstance(exc, config_errors):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    # Never a traceback, but keep enough to report a bug with.
    print(f"error: {type(exc).__name__}: {exc} (this is a bug in gpuplane; please report "
          "it with the command you ran)", file=sys.stderr)
    if os.environ.get("GPUCTL_DEBUG"):
        raise exc
    return EXIT_ERROR


def _has_token(args):
    try:
        from gpuplane.client import resolve
        return bool(resolve(getattr(args, "server", None), getattr(args, "token", None),
                            getattr(args, "home", None))[1])
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
