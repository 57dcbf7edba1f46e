"""Placeholders a job's command and folders may name, filled when its attempt is made.

`{job}`, `{attempt}` and `{run}` are known only when an attempt is dispatched (the run is
made then), so the start message fills them (gateway.start_message): the command's
arguments, `tb_dir` and `watch_dir`; the job record keeps what was written. A sweep fills
its own names (`{trial}`, `{sweep_id}` and its parameters) when it makes a trial's job,
and leaves these three for the start. A placeholder is `{name}` with `name` an
identifier; a shell's `${name}` and `{{name}}` are left alone, and so is every other
brace of a command (awk, Go templates, f-strings). In `tb_dir` and `watch_dir` an unknown
name is refused at submit, naming the known ones, so a typo never becomes a folder name.
"""
import re

JOB = ("job", "attempt", "run")        # filled at dispatch, for every job

# {name}, not ${name} (a shell variable) and not {{name}} (escaped braces)
_PLACEHOLDER = re.compile(r"\{\{|\}\}|(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")


class PlaceholderError(ValueError):
    """A placeholder nobody fills; the message names the known ones."""


def names(text):
    """The placeholder names `text` uses (a string, or a list of strings)."""
    parts = [text] if isinstance(text, str) else list(text or ())
    found = set()
    for part in parts:
        if isinstance(part, str):
            found.update(m.group(1) for m in _PLACEHOLDER.finditer(part) if m.group(1))
    return found


def check(text, known=JOB, where="the command"):
    """Refuse a placeholder outside `known`."""
    unknown = sorted(names(text) - set(known))
    if unknown:
        listed = ", ".join("{" + k + "}" for k in known)
        raise PlaceholderError(
            f"unknown placeholder {{{unknown[0]}}} in {where}; the known ones are {listed}")


def fill(text, values):
    """`text` (a string or a list of strings) with each `{name}` in `values` replaced; every
    other brace is kept as written (a later fill may know the name)."""
    if text is None:
        return None
    if not isinstance(text, str):
        return [fill(part, values) if isinstance(part, str) else part for part in text]

    def one(m):
        name = m.group(1)
        if name is None:
            return m.group(0)
        return str(values[name]) if name in values else m.group(0)

    return _PLACEHOLDER.sub(one, text)
