"""Chat templates rendered as `transformers` renders them, and the character spans a chat trains on.

A template is compiled once (per text) in the environment of transformers' ``apply_chat_template``: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag, its ``tojson`` filter (no HTML escaping, ``indent``/``separators``/``sort_keys``), and the
globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` (no underscore names). It is rendered with
``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...), as strings. The text is then encoded without the post-processor's special
tokens: a template writes its own BOS, so a Llama 3 chat starts with exactly one ``<|begin_of_text|>``.

Which characters are trained (the assistant turns), from one rendering of the whole conversation, as TRL does:

* a template with ``{% generation %}`` blocks: those blocks (transformers' ``return_assistant_tokens_mask``);
* otherwise the template is rendered once more with every trained assistant message's text between two markers
  (Unicode noncharacters, placed inside its leading/trailing whitespace so ``trim`` and ``strip`` keep them). With
  the markers removed that rendering must be the conversation's text exactly (else the example is refused: the
  template rewrites the content in a way that cannot be traced). A turn runs from the end of the template's
  generation prompt (``<|im_start|>assistant\\n``: so Qwen3's ``<think>`` block, which the template writes after it,
  is trained) - or, for templates without one (Mistral), from the start of the content and the whitespace the
  template writes before it (``[/INST] Yes``: the model writes that space) - to its end and through the first
  special token after it (the end of turn: ``<|eot_id|>``, ``<|im_end|>``, ``</s>``).

Tokens are in a span when their characters overlap it (transformers' ``char_to_token`` of its first and last
character).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kubetron.contract.errors import ConfigError

_OPEN, _CLOSE = "\ufdd0", "\ufdd1"  # noncharacters: not text, and no string filter of a template touches them
_MARKER = re.compile(f"[{_OPEN}{_CLOSE}]")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = ({"role": "user", "content": "x"},)


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
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
    """jinja2's namespace refusing underscore attributes (no way to CPython internals)."""

    def __init__(*args, **kwargs):  # jinja2's own signature trick: `namespace(self=...)` stays possible
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not set {name!r} on a namespace")


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """The template compiled once for all examples (compiling is most of the cost of rendering one)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlocks, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    return env.from_string(text)


class ChatTemplate:
    """One chat template of one tokenizer: renders conversations and finds their trained spans."""

    def __init__(self, text: str, tokens: dict[str, str], specials: Sequence[str], where: str):
        try:
            self.template = compile_template(text)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError("finetuning.chat_template", f"{where}: not a jinja template (line {e.lineno}: "
                                                          f"{e.message})") from None
        self.tokens = dict(tokens)
        self.tracks_generation = bool(_GENERATION_TAG.search(text))
        longest_first = sorted(set(specials), key=len, reverse=True)
        self.specials = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        self.prompt_header = self._generation_prompt()

    def render(self, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, tools=tools, documents=None,
                                    add_generation_prompt=generation_prompt, **self.tokens)

    def _generation_prompt(self) -> str:
        """What add_generation_prompt appends to a conversation ("" when the template writes nothing)."""
        try:
            done, asked = self.render(list(_PROBE)), self.render(list(_PROBE), generation_prompt=True)
        except jinja2.TemplateError:
            return ""
        return asked[len(done):] if asked.startswith(done) else ""

    def _tracked(self, messages: list[dict], tools) -> tuple[str, list[tuple[int, int]]]:
        ext = self.template.environment.extensions[_GenerationBlocks.identifier]
        assert isinstance(ext, _GenerationBlocks)
        ext.emitted, ext.spans = [], []
        try:
            for piece in self.template.generate(messages=messages, tools=tools, documents=None,
                                                add_generation_prompt=False, **self.tokens):
                ext.emitted.append(piece)
            return "".join(ext.emitted), ext.spans
        finally:
            ext.emitted = None

    def spans(self, messages: list[dict], trained: Sequence[bool], tools=None) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans to train on). A template error raises
        jinja2.TemplateError; a template that cannot be traced raises ValueError (the caller names the row)."""
        if self.tracks_generation:
            text, blocks = self._tracked(messages, tools)
            if all(trained[i] for i, m in enumerate(messages) if m.get("role") == "assistant"):
                return text, blocks
        else:
            text, blocks = self.render(messages, tools), []
        ends = self._content_ends(text, messages, trained, tools)
        if self.tracks_generation:
            return text, [b for b in blocks if any(b[0] <= end <= b[1] for _, end in ends)]
        return text, self._turns(text, ends)

    def _content_ends(self, text: str, messages: list[dict], trained: Sequence[bool], tools):
        """[(content start or None, content end)] in `text` of each trained assistant message, from a rendering
        with its content between markers."""
        marked = [_with_markers(m) if trained[i] else m for i, m in enumerate(messages)]
        traced = self.render(marked, tools)
        if traced.replace(_OPEN, "").replace(_CLOSE, "") != text:
            raise ValueError("the chat template changes an assistant message's text when it is traced (it slices "
                             "or compares the content); give the template {% generation %} markers")
        out, start = [], None
        for removed, found in enumerate(_MARKER.finditer(traced)):
            at = found.start() - removed  # where the marker stands in `text`
            if found.group() == _OPEN:
                start = at
            else:
                out.append((start, at))
                start = None
        expected = sum(1 for i, m in enumerate(messages) if trained[i] and isinstance(m.get("content"), str))
        if len(out) != expected:
            raise ValueError(f"the chat template writes {len(out)} of the {expected} trained assistant messages' "
                             "text; give the template {% generation %} markers")
        return out

    def _turns(self, text: str, ends: list[tuple[int | None, int]]) -> list[tuple[int, int]]:
        spans, done = [], 0
        for n, (start, end) in enumerate(ends):
            header = text.rfind(self.prompt_header, done, end) if self.prompt_header else -1
            if header >= 0:
                begin = header + len(self.prompt_header)
            elif start is not None:  # the space a template writes before the answer is the answer's first token's
                begin = start - (start - done - len(text[done:start].rstrip()))
            else:
                raise ValueError("cannot tell where an assistant turn starts (its text is cut by the template and "
                                 "the template has no generation prompt); give the template {% generation %} markers")
            limit = self._next_turn(text, ends, n, end)
            found = self.specials.search(text, end, limit) if self.specials else None
            done = found.end() if found else end
            spans.append((begin, done))
        return spans

    def _next_turn(self, text: str, ends, n: int, end: int) -> int:
        """Where the next assistant turn's header (or content) begins: the end of turn is searched before it."""
        if self.prompt_header:
            nxt = text.find(self.prompt_header, end)
            return nxt if nxt >= 0 else len(text)
        later = [s for s, _ in ends[n + 1:] if s is not None]
        return later[0] if later else len(text)


def _with_markers(message: dict) -> dict:
    """The message with its text between the markers, inside the whitespace around it."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    core = content.strip()
    lead = content[:len(content) - len(content.lstrip())]
    trail = content[len(lead) + len(core):]
    return {**message, "content": f"{lead}{_OPEN}{core}{_CLOSE}{trail}"}


def token_mask(encoding, spans: list[tuple[int, int]]) -> list[int]:
    """1 on every token whose characters overlap a span: from the token holding its first character to the one
    holding its last (transformers' assistant mask, from the same tokenizers Encoding)."""
    mask = [0] * len(encoding.ids)
    for start, end in spans:
        first = _token_at(encoding, range(start, end))
        last = _token_at(encoding, range(end - 1, start - 1, -1))
        if first is not None and last is not None:
            mask[first:last + 1] = [1] * (last + 1 - first)
    return mask


def _token_at(encoding, chars: range) -> int | None:
    """The token holding the first of `chars` that belongs to a token (a trimmed space belongs to none)."""
    for c in chars:
        token = encoding.char_to_token(c)
        if token is not None:
            return token
    return None
