"""Placeholders a job's command and folders may name, filled when its attempt is made.

`{job}`, `{attempt}` and `{run}` are known only when an attempt is dispatched (the run is
made then), so the lifecycle fills them into the start message: the command's arguments,
`tb_dir`, `watch_dir` and the evaluation command. A sweep fills its own names (`{trial}`,
`{sweep_id}` and its parameters) when it makes a trial's job, and leaves these three for
the lifecycle. A placeholder is `{name}` with `name` an identifier; `{{` and `}}` are
literal braces, and a shell's `${name}` is left alone. An unknown name is refused at
submit, naming the known ones, so a typo never runs as a literal folder name.
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
            f"unknown placeholder {{{unknown[0]}}} in {where}; the known ones are {listed} "
            "(write {{ and }} for literal braces)")


def fill(text, values):
    """`text` (a string or a list of strings) with each `{name}` in `values` replaced; other
    placeholders and escaped braces are kept as written (a later fill may know them)."""
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


def unescape(text):
    """The last fill's step: `{{` and `}}` become single braces."""
    if text is None:
        return None
    if not isinstance(text, str):
        return [unescape(part) if isinstance(part, str) else part for part in text]
    return _PLACEHOLDER.sub(lambda m: m.group(0)[0] if m.group(1) is None else m.group(0),
                            text)
