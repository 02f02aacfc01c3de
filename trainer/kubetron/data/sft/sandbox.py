"""The jinja2 environment chat templates run in: transformers' sandbox, bounded in memory and time.

A chat template comes with the tokenizer files, which whoever wrote the model directory controls. transformers renders
it in jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation of lists and
dicts); kubetron does the same (:func:`compile_template`) and bounds what the sandbox does not:

* **memory**: no value a template makes - a string, list or number, by an operator (``'x' * 10**10``, ``2 ** 10**9``,
  ``s + s`` doubled in a loop), a call (``'x'.center(10**10)``, ``sep.join(...)``, ``str.format`` widths) or a filter
  (``tojson(indent=10**9)``, ``center``, ``indent``, ``replace``, ``wordwrap``, ``format``, ``join``) - may exceed
  ``MAX_CHARS`` characters (numbers: ``MAX_INT_BITS`` bits), nor may the rendered text. The size is worked out from
  the operands before the operation runs, so nothing large is ever allocated;
* **time**: one rendering may take ``MAX_SECONDS``. The clock is read at every call, operator, namespace assignment
  and piece of output, and, in a main thread, a timer (SIGALRM) also stops loops that do none of these.

Going past either raises :class:`TemplateLimit` (a ``jinja2.TemplateError``), so the row is refused in one line.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_CHARS = 64 * 1024 * 1024  # characters of one value or of one rendered chat
MAX_INT_BITS = 1 << 16  # a number's size (10**19728 at most)
MAX_SECONDS = 10.0  # one rendering
MAX_LIPSUM = 100  # paragraphs of lipsum()


class TemplateLimit(jinja2.TemplateError):
    """A chat template went past its memory or time bound."""


_clock = threading.local()


def _check_time() -> None:
    deadline = getattr(_clock, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimit(f"it ran for more than {MAX_SECONDS:g} s on one chat")


def _too_big(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise TemplateLimit(f"it makes {what} of {n} characters (the bound is {MAX_CHARS})")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _checked(value: Any) -> Any:
    """`value` if it is within bounds (a sequence's length, an int's bits)."""
    _too_big(_size(value), "a value")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"it makes a number of {value.bit_length()} bits (the bound is {MAX_INT_BITS})")
    return value


_WIDTH = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_NUMBER = re.compile(r"\d+")


def _printf_size(fmt: str, args: Any) -> None:
    """``fmt % args`` only when no width or precision passes MAX_CHARS (a `*` takes it from the arguments)."""
    values = args if isinstance(args, tuple) else (args,)
    stars = [v for v in values if isinstance(v, int)]
    for m in _WIDTH.finditer(fmt):
        for part in m.groups():
            if part == "*" and any(abs(v) > MAX_CHARS for v in stars):
                raise TemplateLimit(f"it makes a '%*' field wider than {MAX_CHARS} characters")
            if part and part != "*":
                _too_big(int(part), "a formatted field")
    _too_big(len(fmt) + sum(_size(str(v)) if isinstance(v, (int, float)) else _size(v) for v in values), "a string")


def _binop_size(op: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would pass the bounds, before it runs."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _too_big(len(seq) * max(n, 0), "a repeated sequence")
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimit("it multiplies numbers past the bound")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * left.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"it raises a number to the power {right} (past the bound)")
    elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _too_big(len(left) + len(right), "a joined sequence")
    elif op == "%" and isinstance(left, str):
        _printf_size(left, right)


# str methods whose result can be much larger than the string: the size they would have, before they run
def _str_method_size(s: str, name: str, args: tuple, kwargs: dict) -> int:
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        return max(len(s), width if isinstance(width, int) else 0)
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(s) + s.count("\t") * max(tab if isinstance(tab, int) else 8, 0)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        found = len(s) + 1 if args[0] == "" else s.count(args[0])
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            found = min(found, args[2])
        return len(s) + found * max(len(args[1]) - len(args[0]), 0)
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        parts = args[0]
        return len(s) * max(len(parts) - 1, 0) + sum(_size(p) for p in parts)
    if name in ("format", "format_map"):
        numbers = [int(n) for n in _FORMAT_NUMBER.findall(s)]
        numbers += [v for v in (*args, *kwargs.values()) if isinstance(v, int)]
        return max([len(s), *numbers])
    return 0


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every operator and call checked against the bounds."""

    intercepted_binops = frozenset(("*", "**", "+", "%", "//"))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        _binop_size(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        _check_time()
        bound = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(bound, "__self__", None)
        if isinstance(owner, str):
            _too_big(_str_method_size(owner, getattr(bound, "__name__", ""), args, kwargs), "a string")
        return _checked(super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(name: str, f: Callable) -> Callable:
    """The filter, refusing arguments that would make its result pass the bounds, and checking the result."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        _check_time()
        _filter_size(name, [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment,
                                                                   jinja2.nodes.EvalContext))], kwargs)
        return _checked(f(*args, **kwargs))
    return run


def _filter_size(name: str, args: list, kwargs: dict) -> None:
    value = args[0] if args else None
    text = value if isinstance(value, str) else ""
    rest = args[1:]
    if name == "center":
        _too_big(_str_method_size(text, "center", tuple(rest), kwargs), "a centred string")
    elif name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _too_big(len(text) + (text.count("\n") + 1) * max(per_line, 0), "an indented string")
    elif name == "wordwrap":
        wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
        width = rest[0] if rest else kwargs.get("width", 79)
        lines = len(text) // max(width if isinstance(width, int) else 1, 1) + 1
        _too_big(len(text) + lines * _size(wrap), "a wrapped string")
    elif name == "replace":
        _too_big(_str_method_size(text, "replace", tuple(rest), {}), "a replaced string")
    elif name == "format":
        _printf_size(text, tuple(rest) or kwargs)
    elif name == "join" and isinstance(value, (list, tuple)):
        sep = rest[0] if rest else kwargs.get("d", "")
        _too_big(_size(sep) * max(len(value) - 1, 0) + sum(_size(v) for v in value), "a joined string")


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: records the rendered span of each block while tracking."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.emitted: list[str] | None = None
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller) -> str:
        text = caller()
        if self.emitted is not None:
            start = sum(map(len, self.emitted))
            self.spans.append((start, start + len(text)))
        return text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    if indent is not None:  # every line of the output gets `indent` per level: bound it before dumping
        compact = json.dumps(x, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
        step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        lines = compact.count(",") + compact.count("{") + compact.count("[") + 1
        depth = max(_depth(x), 1)
        _too_big(len(compact) + lines * (1 + max(step, 0) * depth), "a JSON text")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _depth(x, level: int = 0) -> int:
    if level > 1000:  # json.dumps refuses deeper nesting anyway
        return level
    if isinstance(x, dict):
        return max((_depth(v, level + 1) for v in x.values()), default=level + 1)
    if isinstance(x, (list, tuple)):
        return max((_depth(v, level + 1) for v in x), default=level + 1)
    return level


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` in a template builds a plain dict (no attribute access to the type itself)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore attributes (no way to CPython internals), its values bounded."""

    def __init__(*args, **kwargs):  # jinja2's own signature trick: `namespace(self=...)` stays possible
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name, value) -> None:
        _check_time()
        _checked(value)
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not set {name!r} on a namespace")


def _lipsum(n: int = 5, *args, **kwargs):
    if not isinstance(n, int) or n > MAX_LIPSUM:
        raise TemplateLimit(f"lipsum({n!r}): at most {MAX_LIPSUM} paragraphs")
    return jinja2.utils.generate_lorem_ipsum(n, *args, **kwargs)


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """The template compiled once for all examples (compiling is most of the cost of rendering one), in
    transformers' environment: trim_blocks/lstrip_blocks, loopcontrols, {% generation %}, its tojson (no HTML
    escaping), raise_exception, strftime_now, dict and namespace (no underscore names)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols])
    env.filters["tojson"] = _tojson
    for name in list(env.filters):
        env.filters[name] = _bounded_filter(name, env.filters[name])
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace,
                       lipsum=_lipsum)
    return env.from_string(text)


def generation_blocks(template: jinja2.Template) -> _GenerationBlocks:
    ext = template.environment.extensions[_GenerationBlocks.identifier]
    assert isinstance(ext, _GenerationBlocks)
    return ext


def render_bounded(pieces: Iterator[str], emitted: list[str] | None = None) -> str:
    """Join a template's output pieces within the bounds (`emitted`: the list the pieces are appended to)."""
    out = [] if emitted is None else emitted
    total = 0
    with _deadline():
        for piece in pieces:
            total += len(piece)
            _too_big(total, "a chat")
            _check_time()
            out.append(piece)
    return "".join(out)


class _deadline:
    """The time bound of one rendering: a deadline the hooks read, and in a main thread a SIGALRM timer for
    loops that never reach a hook."""

    def __enter__(self):
        _clock.deadline = time.monotonic() + MAX_SECONDS
        self.timer = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
        if self.timer:
            self.previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, MAX_SECONDS + 0.5)
        return self

    def __exit__(self, *exc):
        _clock.deadline = None
        if self.timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def _on_alarm(signum, frame):
    raise TemplateLimit(f"it ran for more than {MAX_SECONDS:g} s on one chat")
