"""Time limits and warning signals, in the words a user types (docs/scheduling.md).

One owner for how `--time` and `--signal` read, shared by the CLI (whose parser module
imports only the standard library), the REST API, sweeps and project defaults:

    2h, 90m, 45s, 1d, 1h30m       a number with a unit (units may be combined)
    90                            a bare number: minutes (as sbatch --time reads it)
    1:30:00, 30:00                H:MM:SS, M:SS (Slurm's forms)
    2-00:00:00, 2-12, 2-12:30     D-HH:MM:SS, D-HH, D-HH:MM

    USR1, SIGUSR1, USR1@60        the warning signal, and how long before the limit it
                                  comes (seconds; Slurm's --signal=USR1@60)
"""
import math
import re
import signal

MAX_S = 365 * 86400                 # a year: anything longer is a typo
DEFAULT_SIGNAL = "USR1"

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_UNIT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])")
# signals a job may be warned with: never KILL or STOP (nothing could be done about them)
_WARNABLE = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "URG", "CONT",
             "WINCH", "XCPU", "PWR")

EXAMPLES = "2h, 90m, 45s, 1h30m, 1:30:00 or 2-00:00:00"


class LimitError(ValueError):
    """A time limit or signal that does not read; the message names the fix."""


def parse(text, what="time limit"):
    """`text` (a string as above, or a number of seconds) -> whole seconds, > 0."""
    if isinstance(text, bool):
        raise LimitError(f"{what} must be a duration such as {EXAMPLES}, got {text!r}")
    if isinstance(text, (int, float)):
        seconds = text
    elif isinstance(text, str):
        seconds = _parse_text(text.strip().lower(), what)
    else:
        raise LimitError(f"{what} must be a duration such as {EXAMPLES}, got {text!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise LimitError(f"{what} must be more than zero, got {text!r}; give a duration "
                         f"such as {EXAMPLES}, or leave it out for none")
    if seconds > MAX_S:
        raise LimitError(f"{what} {text!r} is more than a year; give a duration such as "
                         f"{EXAMPLES}")
    return int(math.ceil(seconds))


def _parse_text(t, what):
    if not t:
        raise LimitError(f"{what} is empty; give a duration such as {EXAMPLES}")
    if re.fullmatch(r"\d+", t):
        return int(t) * 60                      # sbatch: a bare number is minutes
    if re.fullmatch(r"(\s*\d+(\.\d+)?\s*[dhms])+", t):
        return sum(float(n) * _UNITS[u] for n, u in _UNIT_RE.findall(t))
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?", t)
    if m and (m.group(1) or m.group(3)):
        days, a, b, c = (int(g) if g else 0 for g in m.groups())
        if m.group(1):                          # D-HH, D-HH:MM, D-HH:MM:SS
            return days * 86400 + a * 3600 + b * 60 + c
        if m.group(4):                          # H:MM:SS
            return a * 3600 + b * 60 + c
        return a * 60 + b                       # M:SS
    raise LimitError(f"{what} {t!r} does not read as a duration; write it as {EXAMPLES} "
                     "(a bare number is minutes)")


def minutes(seconds):
    """Whole minutes, rounded up: what sbatch --time takes."""
    return None if seconds is None else max(1, -(-int(seconds) // 60))


def describe(seconds):
    """1h30m, 45s, 2d3h: the shortest words for a duration."""
    if seconds is None:
        return None
    seconds = int(seconds)
    parts = []
    for unit, size in _UNITS.items():
        n, seconds = divmod(seconds, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts) or "0s"


def parse_signal(text, default_lead_s):
    """'USR1', 'SIGUSR1', 'USR1@60' -> (name without SIG, lead seconds)."""
    if not isinstance(text, str) or not text.strip():
        raise LimitError("the warning signal must be a name such as USR1, optionally with "
                         "the seconds before the limit it comes: USR1@60")
    name, _, lead = text.strip().upper().partition("@")
    name = name[3:] if name.startswith("SIG") else name
    if name not in _WARNABLE:
        raise LimitError(f"signal {text!r} cannot warn a job; use one of "
                         f"{', '.join(_WARNABLE)}, optionally with the seconds before the "
                         "limit it comes: USR1@60")
    if lead:
        if not re.fullmatch(r"\d{1,6}", lead):
            raise LimitError(f"in {text!r}, what follows '@' must be whole seconds before "
                             "the limit, e.g. USR1@60")
        lead_s = int(lead)
    else:
        lead_s = int(default_lead_s)
    return name, lead_s


def warning_signal(job, server_default):
    """[signal name, seconds before the limit] of a job's warning (a lead given with the
    job's own signal stands; the server's is at most half the limit)."""
    name, lead = parse_signal(server_default or DEFAULT_SIGNAL + "@60", 60)
    own = job.get("time_signal")
    if own:
        own_name, own_lead = parse_signal(own, -1)
        name, lead = own_name, (lead if own_lead < 0 else own_lead)
        if own_lead >= 0:
            return [name, lead]
    limit = job.get("time_limit_s")
    return [name, min(lead, limit // 2) if limit else lead]


def signal_number(name):
    return int(getattr(signal, "SIG" + name))
