"""Chat templates rendered as `transformers` renders them, and the character spans a chat trains on.

A template is compiled once (per text) in transformers' sandbox, bounded in memory and time
(:mod:`kubetron.data.sft.sandbox`), and rendered with ``messages``, ``tools``, ``documents``, ``add_generation_prompt``
and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...), as strings. The text is then encoded
without the post-processor's special tokens: a template writes its own BOS, so a Llama 3 chat starts with exactly one
``<|begin_of_text|>``.

Which characters are trained (the assistant turns: text, tool calls or both), from one rendering of the whole
conversation:

* a template with ``{% generation %}`` blocks: those blocks (transformers' ``return_assistant_tokens_mask``);
* otherwise the template is rendered once more with each trained assistant message's text, and each of its tool
  calls' function name, between two markers (Unicode noncharacters and private-use characters naming the message;
  the text's markers stand inside its leading/trailing whitespace so ``trim`` and ``strip`` keep them, after a
  reasoning block's ``</think>`` so templates that cut it keep them). With the markers removed that rendering must be
  the conversation's text exactly (else the example is refused: the template rewrites the content in a way that
  cannot be traced), and every trained message must show (a template that writes no tool calls is refused for rows
  with them). A turn runs from the end of the template's generation prompt (``<|im_start|>assistant\\n``; Phi-3's
  ``<|assistant|>\\n``, whose template ends a conversation with eos instead, so the prompt is what the two renderings
  share) or from the end of the last non-assistant turn, whichever comes later (``[/INST]`` for Mistral, which has
  no generation prompt; DeepSeek's ``<｜tool▁output▁end｜>`` before an answer to a tool's output) - to the end-of-turn
  token the template writes after an assistant's text (``<|eot_id|>``, ``<|im_end|>``, ``</s>``, ``<|end|>``,
  ``<end_of_turn>``, ``<｜end▁of▁sentence｜>``) after its last marker. The header (``<|start_header_id|>assistant
  <|end_header_id|>``, ``<|assistant|>``, ...) is never trained: the model does not write it.

Tokens are in a span when their characters overlap it (transformers' ``char_to_token`` of its first and last
character).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2

from kubetron.contract.errors import ConfigError
from kubetron.data.sft.sandbox import TemplateLimit, compile_template, generation_blocks, render_bounded

_OPEN, _CLOSE = "\ufdd0", "\ufdd1"  # noncharacters: not text, and no string filter of a template touches them
_TAG0 = 0xE000  # private-use characters after _OPEN name the message: 2k its text, 2k + 1 its tool calls
_MAX_TAGGED = (0xF8FF - _TAG0) // 2
_MARKER = re.compile(f"{_OPEN}[\ue000-\uf8ff]|{_CLOSE}")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_ID = "call00001"  # 9 characters: Mistral's templates insist
_PROBE_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": _PROBE_ID, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@dataclass
class _Marks:
    """Where one trained message shows in the rendered text: its first and last marked character, and its text's
    start (None: only its tool calls show)."""

    first: int
    last: int
    content_start: int | None


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
        self.prompt_header, self.turn_end = self._probe_assistant()
        self.closers = self._probe_closers()

    def render(self, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
        return render_bounded(self.template.generate(messages=messages, tools=tools, documents=None,
                                                     add_generation_prompt=generation_prompt, **self.tokens))

    def _try(self, messages: list[dict], generation_prompt: bool = False) -> str | None:
        try:
            return self.render(messages, generation_prompt=generation_prompt)
        except TemplateLimit:  # a template past its bounds is refused at once, not probed again
            raise
        except Exception:  # a probe the template does not accept (a system role, tool turns): nothing learnt
            return None

    def _probe_assistant(self) -> tuple[str, str | None]:
        """(the generation prompt as an assistant turn starts with it, the token that ends an assistant's turn)."""
        alone, asked = self._try([_PROBE_USER]), self._try([_PROBE_USER], generation_prompt=True)
        answered = self._try([_PROBE_USER, _with_markers({"role": "assistant", "content": "y"}, 0)])
        if alone is None or asked is None or answered is None:
            return "", None
        user_end = self._token_boundary(asked, _common_prefix(alone, asked))
        header = asked[user_end:_common_prefix(asked, answered)]
        after = answered[answered.rfind(_CLOSE) + 1:] if _CLOSE in answered else ""
        return header, self._first_special(after)

    def _probe_closers(self) -> tuple[str, ...]:
        """The special tokens that end a user turn and a tool's turn (where an assistant's turn starts when the
        template has no generation prompt, or writes none before an answer to a tool)."""
        found: list[str] = []
        probes: tuple[list[dict], ...] = ([_mark_text(_PROBE_USER, "user")],
                                          [_PROBE_USER, _PROBE_CALL, _mark_text(
                                              {"role": "tool", "content": "x", "tool_call_id": _PROBE_ID}, "tool")])
        for chat in probes:
            text = self._try(chat)
            if text is not None and _CLOSE in text:
                closer = self._first_special(text[text.rfind(_CLOSE) + 1:])
                if closer and closer not in found:
                    found.append(closer)
        return tuple(found)

    def _first_special(self, text: str) -> str | None:
        found = self.specials.search(text) if self.specials else None
        return found.group() if found else None

    def _token_boundary(self, text: str, at: int) -> int:
        """`at`, moved back to the start of a special token it would cut (Phi-3: "<|endoftext|>" vs "<|assistant|>"
        share "<|")."""
        if self.specials:
            for found in self.specials.finditer(text):
                if found.start() < at < found.end():
                    return found.start()
        return at

    def _tracked(self, messages: list[dict], tools) -> tuple[str, list[tuple[int, int]]]:
        ext = generation_blocks(self.template)
        ext.emitted, ext.spans = [], []
        try:
            text = render_bounded(self.template.generate(messages=messages, tools=tools, documents=None,
                                                         add_generation_prompt=False, **self.tokens), ext.emitted)
            return text, ext.spans
        finally:
            ext.emitted = None

    def spans(self, messages: list[dict], trained: Sequence[bool], tools=None) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans to train on). A template error raises
        jinja2.TemplateError (or whatever the template's Python raised); a template that cannot be traced raises
        ValueError (the caller names the row)."""
        if self.tracks_generation:
            text, blocks = self._tracked(messages, tools)
            if all(trained[i] for i, m in enumerate(messages) if m.get("role") == "assistant"):
                return text, blocks
        else:
            text, blocks = self.render(messages, tools), []
        marks = self._traced(text, messages, trained, tools)
        if self.tracks_generation:
            return text, [b for b in blocks if any(b[0] <= p <= b[1] for m in marks for p in (m.first, m.last))]
        return text, self._turns(text, marks)

    def _traced(self, text: str, messages: list[dict], trained: Sequence[bool], tools) -> list[_Marks]:
        """Where each trained message shows in `text`, from a rendering with its text and tool names marked."""
        order = [i for i, t in enumerate(trained) if t]
        if len(order) > _MAX_TAGGED:
            raise ValueError(f"has {len(order)} assistant turns to train (at most {_MAX_TAGGED} per conversation)")
        tag = {i: k for k, i in enumerate(order)}
        marked = [_with_markers(m, tag[i]) if i in tag else m for i, m in enumerate(messages)]
        traced = self.render(marked, tools)
        if _MARKER.sub("", traced) != text:
            raise ValueError("the chat template changes an assistant message's text when it is traced (it slices "
                             "or compares the content); give the template {% generation %} markers")
        found: dict[int, _Marks] = {}
        removed, open_at, open_tag = 0, 0, 0
        for m in _MARKER.finditer(traced):
            at = m.start() - removed  # where the marker stands in `text`
            removed += len(m.group())
            if m.group() != _CLOSE:
                open_at, open_tag = at, ord(m.group()[1]) - _TAG0
                continue
            k = open_tag // 2
            if k in found:
                found[k].first, found[k].last = min(found[k].first, open_at), max(found[k].last, at)
            else:
                found[k] = _Marks(open_at, at, None)
            if open_tag % 2 == 0 and found[k].content_start is None:
                found[k].content_start = open_at
        for k, i in enumerate(order):
            if k not in found:
                what = "tool calls" if messages[i].get("tool_calls") else "text"
                raise ValueError(f"the chat template writes nothing of message {i + 1} (an assistant turn with "
                                 f"{what}) that can be traced: it does not render them, or rewrites them; give the "
                                 "template {% generation %} markers")
        return sorted(found.values(), key=lambda m: m.first)

    def _turns(self, text: str, marks: list[_Marks]) -> list[tuple[int, int]]:
        spans, done = [], 0
        for n, mark in enumerate(marks):
            begin = self._begin(text, done, mark)
            limit = marks[n + 1].first if n + 1 < len(marks) else len(text)
            if self.prompt_header:  # the end of turn is searched before the next assistant header
                nxt = text.find(self.prompt_header, mark.last, limit)
                limit = nxt if nxt >= 0 else limit
            done = self._end(text, mark.last, limit)
            spans.append((begin, done))
        return spans

    def _begin(self, text: str, done: int, mark: _Marks) -> int:
        """The later of the generation prompt's end and the last non-assistant turn's end before the message."""
        ends = [at + len(s) for s in (self.prompt_header, *self.closers) if s
                for at in (text.rfind(s, done, mark.first),) if at >= 0]
        if ends:
            return max(ends)
        if mark.content_start is not None:  # the space a template writes before the answer is the answer's
            return done + len(text[done:mark.content_start].rstrip())
        raise ValueError("cannot tell where an assistant turn starts (the template has no generation prompt and "
                         "writes no end to the turn before it); give the template {% generation %} markers")

    def _end(self, text: str, last: int, limit: int) -> int:
        """Through the end-of-turn token after the message's last marked character (else the first special
        token there, else the character itself)."""
        if self.turn_end:
            at = text.find(self.turn_end, last, limit)
            if at >= 0:
                return at + len(self.turn_end)
        found = self.specials.search(text, last, limit) if self.specials else None
        return found.end() if found else last


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _marked(text: str, tag: int) -> str:
    """`text` between the markers, inside its leading and trailing whitespace."""
    core = text.strip()
    if not core:
        return text
    lead = text[:len(text) - len(text.lstrip())]
    return f"{lead}{_OPEN}{chr(_TAG0 + tag)}{core}{_CLOSE}{text[len(lead) + len(core):]}"


def _mark_text(message: dict, role: str) -> dict:
    return {**message, "role": role, "content": _marked(message["content"], 0)}


def _with_markers(message: dict, k: int) -> dict:
    """The message with its text (after a reasoning block's ``</think>``) and each tool call's name marked."""
    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        cut = content.rfind("</think>")
        head, tail = (content[:cut + len("</think>")], content[cut + len("</think>"):]) if cut >= 0 else ("", content)
        out["content"] = head + _marked(tail, 2 * k)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_mark_call(c, 2 * k + 1) for c in calls]
    return out


def _mark_call(call, tag: int):
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return {**call, "function": {**function, "name": _marked(function["name"], tag)}}
    if isinstance(call.get("name"), str):
        return {**call, "name": _marked(call["name"], tag)}
    return call


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
