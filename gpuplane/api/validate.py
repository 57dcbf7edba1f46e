"""Request parsing: every route turns bad input into a 400 with a sentence naming the fix."""
import json
import math

from flask import request

from ..errors import BadRequest

_MISSING = object()


def body():
    """The JSON object sent, or a 400."""
    raw = request.get_data(cache=True)
    if not raw:
        raise BadRequest("the body is empty; send a JSON object")
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(data).__name__}")
    return data


def parse_json(raw):
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON ({e}); send a JSON object") from None


def field(data, name, kind, default=_MISSING, *, min=None, max=None, choices=None,
          max_len=None, nullable=False):
    """Pick one field of a parsed body and check its type and range."""
    if name not in data or (data[name] is None and default is not _MISSING):
        if default is _MISSING:
            raise BadRequest(f"'{name}' is required")
        return default
    v = data[name]
    if v is None and nullable:
        return None
    label = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             dict: "an object", list: "a list"}[kind]
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        raise BadRequest(f"'{name}' must be {label}, got {json.dumps(v)[:60]}")
    if kind in (int, float):
        if kind is float and not math.isfinite(v):
            raise BadRequest(f"'{name}' must be a finite number")
        if min is not None and v < min:
            raise BadRequest(f"'{name}' must be at least {min}, got {v}")
        if max is not None and v > max:
            raise BadRequest(f"'{name}' must be at most {max}, got {v}")
    if kind is str:
        check_text(v, name)
    if choices is not None and v not in choices:
        raise BadRequest(f"'{name}' must be one of {', '.join(map(str, choices))}; got {v!r}")
    if max_len is not None and len(v) > max_len:
        raise BadRequest(f"'{name}' is too long ({len(v)}; at most {max_len})")
    return v


def check_text(v, name):
    """A string that can reach an environment variable, an argv or a file name (an event
    hook's GPUCTL_EVENT_*, a job's argv): no NUL byte, and encodable as UTF-8 (JSON can
    carry a lone surrogate, which no such place can hold)."""
    if "\0" in v:
        raise BadRequest(f"'{name}' contains a NUL byte, which no environment variable, "
                         "argument or file name can hold; remove it")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{name}' contains a lone surrogate (\\ud800-\\udfff), which is "
                         "not text; send it as UTF-8") from None
    return v


def opt_number(data, name, kind):
    """An optional number field (int or float), None when absent; ints from 0 to 2**63-1."""
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            isinstance(v, float) and not math.isfinite(v)):
        raise BadRequest(f"'{name}' must be a number or null")
    if kind is int and not 0 <= v < 2**63:
        raise BadRequest(f"'{name}' must be from 0 to 2**63-1")
    return kind(v)


def query_state(states, name="state"):
    """An optional state filter from the query string, upper-cased, one of `states`."""
    state = request.args.get(name)
    if state is None:
        return None
    state = state.upper()
    if state not in states:
        raise BadRequest(f"unknown {name} {state!r}; use one of {', '.join(states)}")
    return state


def query_int(name, default, *, min=None, max=None):
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter '{name}' must be an integer, got {raw[:40]!r}") from None
    if not -2**63 <= v < 2**63:
        raise BadRequest(f"query parameter '{name}' is out of range")
    if min is not None and v < min:
        raise BadRequest(f"query parameter '{name}' must be at least {min}")
    if max is not None and v > max:
        raise BadRequest(f"query parameter '{name}' must be at most {max}")
    return v


def query_ids(name, most=1000):
    """?name=1,2,3 as a list of distinct ids in the order given, or None when absent."""
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        ids = list(dict.fromkeys(int(x) for x in raw.split(",") if x.strip()))
    except ValueError:
        raise BadRequest(f"'{name}' must be ids separated by commas, e.g. {name}=3,4; "
                         f"got {raw[:60]!r}") from None
    if not ids or len(ids) > most or not all(0 < i < 2**63 for i in ids):
        raise BadRequest(f"'{name}' must list 1 to {most} ids (positive integers), "
                         f"e.g. {name}=3,4")
    return ids
