"""Tokenizers that need no downloads.

* ``byte``: UTF-8 bytes. Ids 0..255 are the bytes, ``eod = 256``, ``pad = 257``,
  ``vocab_size = 258`` (the base size; the model pads it up, see ``model.vocab_size``).
* ``null``: no text at all, just a vocabulary size, for mock data with any vocabulary:
  ``eod = vocab_size - 1``, ``pad = eod`` (ids ``0..vocab_size-2`` are ordinary tokens).
"""

from __future__ import annotations

import numpy as np

from kubetron.errors import ConfigError

TOKENIZER_TYPES = ("byte", "null")


class ByteTokenizer:
    """Byte-level tokenizer: a token is one UTF-8 byte."""

    tokenizer_type = "byte"
    eod = 256
    pad = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_np(self, text: str, append_eod: bool = False) -> np.ndarray:
        """Fast path for preprocessing: uint16 ids, with ``eod`` appended if asked."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        out = np.empty(raw.size + (1 if append_eod else 0), dtype=np.uint16)
        out[: raw.size] = raw
        if append_eod:
            out[-1] = self.eod
        return out

    def decode(self, ids) -> str:
        """Bytes back to text; ``eod``/``pad`` (and anything >= 256) are dropped,
        undecodable byte sequences become U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258, eod=256, pad=257)"


class NullTokenizer:
    """A vocabulary size and nothing else (mock data): ``eod = pad = vocab_size - 1``."""

    tokenizer_type = "null"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 2:
            raise ConfigError(
                "tokenizer.vocab_size", f"the null tokenizer needs a vocab_size >= 2, got {vocab_size!r}"
            )
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = self.eod

    def encode(self, text: str) -> list[int]:
        raise ConfigError("tokenizer.tokenizer_type", "the null tokenizer cannot encode text; use 'byte'")

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


def build_tokenizer(tokenizer_type: str, vocab_size: int | None = None) -> ByteTokenizer | NullTokenizer:
    """``byte`` (vocab_size ignored, always 258) or ``null`` (vocab_size required)."""
    kind = (tokenizer_type or "").strip().lower()
    if kind in ("byte", "bytetokenizer", "byte_level"):
        return ByteTokenizer()
    if kind in ("null", "nulltokenizer"):
        return NullTokenizer(vocab_size)
    raise ConfigError(
        "tokenizer.tokenizer_type",
        f"unknown tokenizer {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}",
    )
