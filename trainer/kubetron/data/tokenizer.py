"""Tokenizers, with Megatron's names.

* ``byte``: UTF-8 bytes. Ids 0..255 are the bytes, ``eod = 256``, ``pad = 257``,
  ``vocab_size = 258`` (the base size; the model pads it up, see ``model.vocab_size``).
* ``null``: no text at all, just a vocabulary size, for mock data with any vocabulary:
  ``eod = vocab_size - 1``, ``pad = eod`` (ids ``0..vocab_size-2`` are ordinary tokens).
* ``HuggingFaceTokenizer``: a ``tokenizer.json`` (or a directory holding one, with its
  ``tokenizer_config.json`` / ``special_tokens_map.json`` and chat templates when present), run by the
  ``tokenizers`` library; no ``transformers``. Text is encoded with the tokenizer's post-processor (a Llama
  tokenizer adds its BOS), as Megatron's ``HuggingFaceTokenizer.tokenize`` does. Its chat templates are
  read where ``transformers`` reads them (:func:`chat_templates`).
* ``SentencePieceTokenizer``: a SentencePiece ``.model`` (Megatron's GPT SentencePiece semantics:
  no extra tokens, no BOS added; ``eod`` is the model's ``</s>``).
* ``GPT2BPETokenizer``: GPT-2's ``vocab.json`` + ``merges.txt`` (byte-level BPE, ``eod`` is
  ``<|endoftext|>``).

A file-based tokenizer is defined by its *assets*: ``{file name: bytes}``, the same files a
checkpoint carries in ``iter_N/tokenizer/`` (:func:`tokenizer_assets`), so a checkpoint is
self-contained and :func:`tokenizer_from_assets` rebuilds exactly the tokenizer it was trained with.
Paths may be local (a mounted volume) or ``s3://bucket/key`` (read through :mod:`kubetron.storage`).
"""

from __future__ import annotations

import hashlib
import json
import os

from kubetron.contract.errors import ConfigError

TOKENIZER_TYPES = ("byte", "null", "HuggingFaceTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer")
FILE_TOKENIZERS = TOKENIZER_TYPES[2:]
# The files of an HF tokenizer directory a checkpoint carries (besides CHAT_TEMPLATE_DIR/*.jinja), copied verbatim.
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "chat_template.json")
# transformers' folder of named chat templates (NAME.jinja), next to chat_template.jinja (the default one).
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The special-token names transformers passes to a chat template (tokenizer.special_tokens_map).
TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# End-of-document candidates when a bare tokenizer.json says nothing (most common first).
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<|eot_id|>", "[SEP]")


class ByteTokenizer:
    """Byte-level tokenizer: a token is one UTF-8 byte."""

    tokenizer_type = "byte"
    eod = 256
    pad = 257
    bos = None
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    encode_plain = encode_batch  # no special tokens are ever added

    def encode_np(self, text: str, append_eod: bool = False):
        """Fast path for preprocessing: uint16 ids, with ``eod`` appended if asked."""
        import numpy as np

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

    def decode_all(self, ids) -> str:
        """The text of `ids` with eod and pad written out (kubetron inspect-data)."""
        names = {self.eod: "<eod>", self.pad: "<pad>"}
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if int(i) in names:
                out += [self.decode(run), names[int(i)]]
                run = []
            else:
                run.append(int(i))
        return "".join(out) + self.decode(run)

    def assets(self) -> dict[str, bytes]:
        return {}

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258, eod=256, pad=257)"


class NullTokenizer:
    """A vocabulary size and nothing else (mock data): ``eod = pad = vocab_size - 1``."""

    tokenizer_type = "null"
    bos = None

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or int(vocab_size) < 2:
            raise ConfigError(
                "tokenizer.vocab_size", f"the null tokenizer needs a vocab_size >= 2, got {vocab_size!r}"
            )
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = self.eod

    def encode(self, text: str) -> list[int]:
        raise ConfigError("tokenizer.tokenizer_type", "the null tokenizer cannot encode text; use 'byte'")

    encode_batch = encode_plain = encode

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def assets(self) -> dict[str, bytes]:
        return {}

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


class _FileTokenizer:
    """Common part of the file-based tokenizers: assets, batch encoding, numpy output."""

    tokenizer_type = ""
    vocab_size: int
    eod: int

    bos: int | None = None
    pad: int | None = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text without the special tokens a post-processor adds (for these tokenizers: none)."""
        return self.encode_batch(texts)

    def __init__(self, files: dict[str, bytes], source: str = ""):
        self._files = dict(files)
        self.source = source

    def assets(self) -> dict[str, bytes]:
        """The files that define this tokenizer (what a checkpoint stores)."""
        return dict(self._files)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_np(self, text: str, append_eod: bool = False):
        import numpy as np

        ids = self.encode(text)
        return np.asarray(ids + [self.eod] if append_eod else ids, dtype=np.int64)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.source or 'assets'}, vocab_size={self.vocab_size}, eod={self.eod}, "
                f"bos={self.bos}, pad={self.pad})")


def _token_name(value) -> str | None:
    """``"</s>"`` or ``{"content": "</s>", ...}`` (tokenizer_config.json's two spellings)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(_FileTokenizer):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``; special ids from its config files."""

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, files: dict[str, bytes], source: str = ""):
        from tokenizers import Tokenizer

        super().__init__(files, source)
        try:
            self._tok = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as exc:  # a JSON or schema error inside the Rust parser
            raise ConfigError("tokenizer.tokenizer_model", f"{source}: not a tokenizer.json: {exc}") from None
        meta = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            if name in files:
                meta.update(json.loads(files[name]))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos = self._id(meta.get("bos_token"))
        self.pad = self._id(meta.get("pad_token"))
        eod = self._id(meta.get("eos_token"))
        if eod is None:
            eod = next((i for i in map(self._tok.token_to_id, EOD_CANDIDATES) if i is not None), None)
        if eod is None:
            raise ConfigError("tokenizer.tokenizer_model", f"{source}: no end-of-document token (no eos_token in "
                              f"tokenizer_config.json and none of {', '.join(EOD_CANDIDATES)} in the vocabulary)")
        self.eod = eod
        self.chat_templates = chat_templates(files, source)
        # The named special tokens as transformers hands them to a chat template ({{ bos_token }} ...).
        self.template_tokens = {k: _token_name(meta[k]) for k in TEMPLATE_TOKEN_NAMES if _token_name(meta.get(k))}

    def _id(self, token) -> int | None:
        name = _token_name(token)
        return None if name is None else self._tok.token_to_id(name)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def encode_plain(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_offsets(self, texts: list[str]) -> list:
        """tokenizers Encodings (``.ids``, ``.char_to_token(i)``) of each text, without the post-processor's
        special tokens: what transformers' apply_chat_template(tokenize=True) encodes (a template writes its own)."""
        return self._tok.encode_batch(texts, add_special_tokens=False)

    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """The added tokens marked special (a chat's control tokens: <|eot_id|>, <|im_end|>, </s> ...)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_all(self, ids) -> str:
        """The text of `ids` with the special tokens written out (kubetron inspect-data)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece model: ``vocab_size`` pieces, ``eod = eos_id``, ``bos``/``pad`` if defined."""

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, files: dict[str, bytes], source: str = ""):
        import sentencepiece

        super().__init__(files, source)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(files["tokenizer.model"])
        except Exception:
            raise ConfigError("tokenizer.tokenizer_model", f"{source}: not a SentencePiece model") from None
        self.vocab_size = self._sp.get_piece_size()
        if self._sp.eos_id() < 0:
            raise ConfigError("tokenizer.tokenizer_model", f"{source}: the SentencePiece model has no </s> token")
        self.eod = self._sp.eos_id()
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])  # control pieces (eos/bos/pad) decode to nothing


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (run by ``tokenizers``)."""

    tokenizer_type = "GPT2BPETokenizer"

    def __init__(self, files: dict[str, bytes], source: str = ""):
        _FileTokenizer.__init__(self, files, source)
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        try:
            vocab = json.loads(files["vocab.json"])
        except ValueError as exc:
            raise ConfigError("tokenizer.vocab_file", f"{source}: not a JSON vocabulary ({exc})") from None
        lines = files["merges.txt"].decode("utf-8").splitlines()
        pairs = [ln.split(" ") for ln in lines if ln and not ln.startswith("#version")]
        if any(len(m) != 2 for m in pairs):
            raise ConfigError("tokenizer.merge_file", f"{source}: a merges.txt line is not two tokens")
        merges = [(a, b) for a, b in pairs]
        self._tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        if "<|endoftext|>" not in vocab:
            raise ConfigError("tokenizer.vocab_file", f"{source}: no <|endoftext|> token in vocab.json")
        self._tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        self.vocab_size = len(vocab)
        self.eod = vocab["<|endoftext|>"]
        self.bos = self.pad = None
        self.chat_templates, self.template_tokens = {}, {}


def chat_templates(files: dict[str, bytes], source: str = "") -> dict[str, str]:
    """``{name: template}`` read as transformers reads them: ``chat_template.jinja`` ("default") and
    ``additional_chat_templates/NAME.jinja`` win over ``tokenizer_config.json``'s ``chat_template`` (a string,
    "default", or a list of ``{name, template}``); ``chat_template.json`` (a processor's legacy file) comes last."""
    field = "tokenizer.tokenizer_model"
    named = {name[len(CHAT_TEMPLATE_DIR) + 1:-len(".jinja")]: data for name, data in files.items()
             if name.startswith(CHAT_TEMPLATE_DIR + "/") and name.endswith(".jinja")}
    jinja = {"default": files["chat_template.jinja"]} if "chat_template.jinja" in files else {}
    if jinja or named:
        return {name: _text(data, f"{source}/{name}.jinja", field) for name, data in {**jinja, **named}.items()}
    for file_name in ("tokenizer_config.json", "chat_template.json"):
        if file_name in files:
            found = _config_templates(files[file_name], f"{source}/{file_name}", field)
            if found:
                return found
    return {}


def _text(data: bytes, where: str, field: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(field, f"{where}: not UTF-8 text") from None


def _config_templates(data: bytes, where: str, field: str) -> dict[str, str]:
    """The ``chat_template`` entry of a JSON file: a string, or transformers' list of ``{name, template}``."""
    try:
        value = json.loads(data).get("chat_template")
    except (ValueError, AttributeError):
        raise ConfigError(field, f"{where}: not a JSON object") from None
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ConfigError(field, f"{where}: chat_template is neither a string nor a list of {{name, template}}")


_CLASSES = {c.tokenizer_type: c for c in (HuggingFaceTokenizer, SentencePieceTokenizer, GPT2BPETokenizer)}


# ---------------------------------------------------------------------------------------------
# reading tokenizer files (local or s3://) and building from config / assets


def _read(path: str, field: str) -> bytes:
    """A file's bytes from a local path or ``s3://bucket/key``; ConfigError naming ``field`` if absent."""
    data = _read_optional(path, field)
    if data is None:
        raise ConfigError(field, f"{path}: no such file")
    return data


def _read_optional(path: str, field: str) -> bytes | None:
    """A file's bytes, or None when there is no such file; ConfigError naming ``field`` if unreadable."""
    try:
        if path.startswith("s3://"):
            from kubetron.storage import open_store

            parent, _, name = path.rstrip("/").rpartition("/")
            store = open_store(parent)
            if not store.exists(name):
                return None
            return store.read_bytes(name)
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:
        raise ConfigError(field, f"{path}: cannot read ({exc.strerror or exc})") from None


def _is_dir(path: str) -> bool:
    if path.startswith("s3://"):
        return not path.rstrip("/").rpartition("/")[2].count(".")  # s3 has no directories: a dot-less leaf
    return os.path.isdir(path)


def _model_files(path: str, main: str, extras: tuple[str, ...] = ()) -> dict[str, bytes]:
    """``main`` (and optional ``extras``) from a directory, or ``path`` itself stored as ``main``."""
    field = "tokenizer.tokenizer_model"
    if not path:
        raise ConfigError(field, "required for this tokenizer_type (a file, or a directory holding "
                                 f"{main}); local path or s3://")
    if not _is_dir(path):
        return {main: _read(path, field)}
    base = path.rstrip("/")
    files = {main: _read(f"{base}/{main}", field)}
    for name in extras:
        data = _read_optional(f"{base}/{name}", field)
        if data is not None:
            files[name] = data
    return files


def _named_templates(path: str) -> dict[str, bytes]:
    """``additional_chat_templates/NAME.jinja`` of an HF tokenizer directory (local or s3://), as asset names."""
    if not _is_dir(path):
        return {}
    base = f"{path.rstrip('/')}/{CHAT_TEMPLATE_DIR}"
    if base.startswith("s3://"):
        from kubetron.storage import open_store

        names = [n for n in open_store(base).list() if "/" not in n]
    else:
        names = sorted(os.listdir(base)) if os.path.isdir(base) else []
    return {f"{CHAT_TEMPLATE_DIR}/{n}": _read(f"{base}/{n}", "tokenizer.tokenizer_model")
            for n in names if n.endswith(".jinja")}


def tokenizer_assets(tok_cfg) -> dict[str, bytes]:
    """``{file name: bytes}`` of the tokenizer a ``tokenizer`` config section names (``{}`` for byte/null).

    These are the files saved in every checkpoint's ``tokenizer/`` directory. Accepts the config
    section (``cfg.tokenizer``) or the whole ``ConfigContainer``.
    """
    tok_cfg = getattr(tok_cfg, "tokenizer", tok_cfg)
    held = getattr(tok_cfg, "assets", None)
    if callable(held) and held() is not None:
        return dict(held())  # adopted from a checkpoint (resume)
    kind = tok_cfg.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        files = _model_files(tok_cfg.tokenizer_model, "tokenizer.json", HF_FILES[1:])
        return {**files, **_named_templates(tok_cfg.tokenizer_model)}
    if kind == "SentencePieceTokenizer":
        return _model_files(tok_cfg.tokenizer_model, "tokenizer.model")
    if kind == "GPT2BPETokenizer":
        for field in ("vocab_file", "merge_file"):
            if not getattr(tok_cfg, field, None):
                raise ConfigError(f"tokenizer.{field}", "required for tokenizer_type GPT2BPETokenizer")
        return {"vocab.json": _read(tok_cfg.vocab_file, "tokenizer.vocab_file"),
                "merges.txt": _read(tok_cfg.merge_file, "tokenizer.merge_file")}
    return {}


def tokenizer_from_assets(tokenizer_type: str, assets: dict[str, bytes], source: str = ""):
    """Rebuild a file-based tokenizer from its assets (a dict, or a local directory holding them)."""
    if isinstance(assets, str):
        source = source or assets
        assets = _local_tree(assets)
    cls = _CLASSES.get(tokenizer_type)
    if cls is None:
        raise ConfigError("tokenizer.tokenizer_type", f"{tokenizer_type!r} has no tokenizer files")
    return _cached(cls, assets, source)


def _local_tree(root: str) -> dict[str, bytes]:
    """Every file under a local directory, named by its relative path with "/" (a checkpoint's tokenizer/)."""
    out = {}
    for parent, dirs, names in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(parent, root).replace(os.sep, "/")
        for n in sorted(names):
            out[n if rel == "." else f"{rel}/{n}"] = _read(os.path.join(parent, n), "tokenizer.tokenizer_model")
    return out


_CACHE: dict[tuple, _FileTokenizer] = {}


def _cached(cls, assets: dict[str, bytes], source: str):
    """One instance per (class, file contents): configs, datasets and checkpoints share it."""
    digest = hashlib.sha256()
    for name in sorted(assets):
        digest.update(name.encode() + b"\0" + hashlib.sha256(assets[name]).digest())
    key = (cls, digest.hexdigest())
    if key not in _CACHE:
        _CACHE[key] = cls(assets, source)
    return _CACHE[key]


def build_tokenizer(tokenizer_type, vocab_size: int | None = None):
    """A tokenizer from a config section (``cfg.tokenizer``), or from a type name for byte/null.

    ``build_tokenizer("byte")``, ``build_tokenizer("null", 1000)`` or ``build_tokenizer(cfg.tokenizer)``
    for every type (file-based ones read their files, see :func:`tokenizer_assets`).
    """
    if not isinstance(tokenizer_type, str):
        tok_cfg = tokenizer_type
        kind = tok_cfg.tokenizer_type
        if kind in FILE_TOKENIZERS:
            source = tok_cfg.tokenizer_model or tok_cfg.vocab_file or ""
            return tokenizer_from_assets(kind, tokenizer_assets(tok_cfg), source)
        return build_tokenizer(kind, getattr(tok_cfg, "vocab_size", None) or vocab_size)
    kind = (tokenizer_type or "").strip().lower()
    if kind in ("byte", "bytetokenizer", "byte_level"):
        return ByteTokenizer()
    if kind in ("null", "nulltokenizer"):
        return NullTokenizer(vocab_size)
    raise ConfigError(
        "tokenizer.tokenizer_type",
        f"unknown tokenizer {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}",
    )
