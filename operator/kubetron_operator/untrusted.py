"""What tenants' pods and stores say is hostile input (docs/security.md): bounded before it is parsed,
range-checked after, and its text made safe before it reaches a log line, an Event or status.

- `load_json`: at most `limit` characters, nested at most MAX_DEPTH deep, integers that fit int64 (the
  CRD's integers), finite floats; anything else raises Untrusted (a ValueError whose message says why
  and carries no part of the payload); text that is not JSON at all raises a plain ValueError.
- `count`: a non-negative int64 from the trainer's JSON, or Untrusted.
- `clean`: a string with every control character (newlines, ANSI escapes, C1, Unicode line separators
  and bidirectional overrides) written as its escape (`\\n`, `\\x1b`), cut to a length: a trainer cannot
  forge an operator log line or hide text in a terminal. `clean_all` applies it inside a JSON value.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 16  # the trainer's payloads nest 2 deep
INT64_MAX = 2**63 - 1
TEXT_LIMIT = 1024  # characters of one message kept (an Event's message is cut there too)
STATUS_TEXT_LIMIT = 4096  # characters of any string of a status patch (the operator's words around a pod's)
LOG_LIMIT = 8192  # characters of one line of the operator's log (a traceback's lines come after it)

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")


class Untrusted(ValueError):
    """A payload the operator refuses; its message says why, without quoting the payload."""


def load_json(text: str, limit: int, depth: int = MAX_DEPTH) -> Any:
    """`text` as JSON, within the bounds of the module docstring, else Untrusted."""
    if len(text) > limit:
        raise Untrusted(f"{len(text)} characters, more than {limit}")
    if nesting(text) > depth:
        raise Untrusted(f"nested more than {depth} levels deep")
    try:
        return json.loads(text, parse_int=_int64, parse_float=_finite, parse_constant=_constant)
    except RecursionError:  # nesting() said otherwise: refuse all the same
        raise Untrusted(f"nested more than {depth} levels deep") from None


def nesting(text: str) -> int:
    """How deep the brackets of a JSON text nest (outside its strings)."""
    depth = deepest = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _int64(digits: str) -> int:
    if len(digits.lstrip("-")) > 19 or not -INT64_MAX - 1 <= (value := int(digits)) <= INT64_MAX:
        raise Untrusted(f"an integer of {len(digits)} digits, beyond int64")
    return value


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Untrusted("a number beyond the range of a double")
    return value


def _constant(name: str) -> float:
    raise Untrusted(f"{name} is not a number")


def count(value: Any, what: str) -> int | None:
    """None, or a non-negative int64 (a whole float is taken); else Untrusted naming `what`."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise Untrusted(f"{what} is not a count (a non-negative int64)")
    return value


def clean(text: Any, limit: int | None = TEXT_LIMIT) -> str:
    """`text` (any value: str() of it) without raw control characters, at most `limit` characters."""
    out = _CONTROL.sub(_escape, str(text))
    return out if limit is None or len(out) <= limit else out[: max(0, limit - 3)] + "..."


def _escape(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def clean_all(value: Any, limit: int | None = None) -> Any:
    """A JSON value with `clean(..., limit)` applied to every string in it (keys included)."""
    if isinstance(value, str):
        return clean(value, limit)
    if isinstance(value, dict):
        return {clean_all(k, limit): clean_all(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_all(v, limit) for v in value]
    return value
