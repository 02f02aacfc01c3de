"""Tokenizers built like the real chat models' (for the SFT tests and bench/sft_data.py), saved by `transformers`'
`save_pretrained` exactly as a user's model directory is: a byte-level BPE trained here with Llama 3's pre-tokenizer,
post-processor (prepends <|begin_of_text|>) and special tokens and Llama 3.2's chat template; Qwen3's (no BOS, <think>
and <tool_call> added but not special) with Qwen3's official template; Mistral v0.3's (a Metaspace BPE, "<s> $A",
[INST]/[/INST] control tokens) with its [INST] template. The templates are the models' published text."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
# Llama 3.2 Instruct (meta-llama/Llama-3.2-1B-Instruct): a system block with the date (strftime_now), the BOS
# written by the template, <|eot_id|> after every turn.
LLAMA32_TEMPLATE = (TEMPLATES / "llama3.2-instruct.jinja").read_text()
# Qwen3 (Qwen/Qwen3-8B): <think> blocks only on assistant turns after the last user query.
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()
# Mistral-7B-Instruct-v0.3: [INST] ... [/INST], the system message put into the LAST user turn, " " + answer + </s>.
MISTRAL_V3_TEMPLATE = (TEMPLATES / "mistral-7b-instruct-v0.3.jinja").read_text()

# The pre-tokenizer splits of Llama 3 (three digits per number) and Qwen2/3 (one digit).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "What is the capital of France? Paris is the capital of France.",
    "Snow is white. The sky is blue. Grass is green; 7+3=10 and 12*12=144.",
    "You are a helpful assistant. Answer briefly and politely, please.",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 system user assistant",
    "Let me think step by step about the question before I answer it.",
]

CHATS = [  # single- and multi-turn, with a system prompt, reasoning and content parts
    [{"role": "user", "content": "What color is snow?"}, {"role": "assistant", "content": "Snow is white."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And 7+3?"}, {"role": "assistant", "content": "7+3=10."}],
    [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Yes, the sky is blue."},
     {"role": "user", "content": "Grass?"}, {"role": "assistant", "content": "Grass is green.\n"},
     {"role": "user", "content": "12*12?"}, {"role": "assistant", "content": "144"}],
]


def _bpe(split: str, specials: list[str], vocab_size: int = 400):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def _save(tok, out: Path, template: str | dict | None, legacy: bool, **special) -> Path:
    """`legacy`: the template inside tokenizer_config.json, as transformers before 4.4x saved it (today:
    chat_template.jinja, and additional_chat_templates/NAME.jinja for named ones)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(out, save_jinja_files=not legacy)
    return out


def llama3_tokenizer(out: Path, template: str | dict | None = LLAMA32_TEMPLATE, legacy: bool = False) -> Path:
    """Llama 3's shape: its split regex, byte-level BPE, a post-processor that prepends <|begin_of_text|> to
    everything it encodes (ByteLevel + TemplateProcessing), eos <|eot_id|>."""
    from tokenizers import processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _bpe(LLAMA3_SPLIT, specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return _save(tok, out, template, legacy, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def qwen3_tokenizer(out: Path, template: str | dict | None = QWEN3_TEMPLATE, legacy: bool = False) -> Path:
    """Qwen3's shape: Qwen's split, byte-level BPE, no BOS, <|im_start|>/<|im_end|> special, <think>/</think> and
    <tool_call>/</tool_call> added but not special; eos <|im_end|>, pad <|endoftext|>."""
    from tokenizers import AddedToken, processors

    tok = _bpe(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _save(tok, out, template, legacy, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def mistral_tokenizer(out: Path, template: str | dict | None = MISTRAL_V3_TEMPLATE, legacy: bool = False) -> Path:
    """Mistral v0.3's shape: a Metaspace BPE ("▁" for spaces, prepended at the start), a post-processor
    "<s> $A", [INST]/[/INST] as control (special) tokens; bos <s>, eos </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    chars = sorted(set("".join(CORPUS) + "\n▁"))
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                             initial_alphabet=chars))
    # Trained word by word (SentencePiece's pieces never cross a space), run on whole texts as Mistral's is.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return _save(tok, out, template, legacy, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


BUILDERS = {"llama3": llama3_tokenizer, "qwen3": qwen3_tokenizer, "mistral": mistral_tokenizer}


def hf_chat_ids(tok_dir: Path, messages: list[dict], **kw) -> list[int]:
    """What `transformers` trains on for a chat: apply_chat_template(messages, tokenize=True)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sample_digest(ds) -> str:
    """A digest of every sample a fine-tuning dataset serves (one epoch), to compare two builds."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for i in range(len(ds)):
        for k, v in sorted(ds[i].items()):
            h.update(k.encode() + np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# The template families of the SFT oracle suite (tests/test_sft_oracle.py): each a tokenizer built like the model's
# with the model's published chat template, as TRL ships them (trl/chat_templates/*.jinja, the published texts), and
# the template transformers computes the assistant mask with: TRL's training variant (the same text with
# {% generation %} blocks) where TRL has one that renders the published text, else one written here the same way
# (tests/chat_templates/*-training.jinja: TRL's Qwen3 variant keeps every turn's <think> block).

def trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]


def llama31_tokenizer(out: Path, template: str | dict | None = None) -> Path:
    """Llama 3.1's shape (Llama 3's, with <|eom_id|> and <|python_tag|>) and its published template."""
    from tokenizers import processors

    tok = _bpe(LLAMA3_SPLIT, LLAMA_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])])
    return _save(tok, out, template or trl_template("llama3_1"), False, bos_token="<|begin_of_text|>",
                 eos_token="<|eot_id|>")


def qwen25_tokenizer(out: Path, template: str | dict | None = None) -> Path:
    """Qwen2.5's shape (Qwen3's tokenizer without <think>) and its published template (a default system prompt)."""
    from tokenizers import AddedToken, processors

    tok = _bpe(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _save(tok, out, template or trl_template("qwen2_5"), False, eos_token="<|im_end|>",
                 pad_token="<|endoftext|>")


def _sentencepiece_like(specials: list[str], prepend: str = "first"):
    """A Metaspace BPE as SentencePiece models are run by tokenizers (Llama 2, Mistral, Phi-3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=True)
    chars = sorted(set("".join(CORPUS + TOOL_CORPUS) + "\n▁"))
    tok.train_from_iterator((CORPUS + TOOL_CORPUS) * 20, trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=chars))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    return tok


def _bos_first(tok, bos: str):
    """A post-processor that puts `bos` before every text (SentencePiece models as transformers runs them)."""
    from tokenizers import processors

    return processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])


def phi3_tokenizer(out: Path, template: str | dict | None = None) -> Path:
    """Phi-3's shape: Llama 2's SentencePiece BPE ("<s> $A"), chat tokens added with rstrip (so "<|assistant|>"
    takes the newline after it, as in Phi-3-mini's tokenizer.json); bos <s>, eos <|endoftext|>."""
    from tokenizers import AddedToken

    tok = _sentencepiece_like(["<unk>", "<s>", "</s>"])
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)] + [
        AddedToken(t, special=True, rstrip=True, normalized=False)
        for t in ("<|assistant|>", "<|end|>", "<|user|>", "<|system|>")])
    tok.post_processor = _bos_first(tok, "<s>")
    return _save(tok, out, template or trl_template("phi3"), False, bos_token="<s>", eos_token="<|endoftext|>",
                 unk_token="<unk>")


def gemma2_tokenizer(out: Path, template: str | dict | None = None) -> Path:
    """Gemma 2's shape: a SentencePiece BPE without a prefix space, "<bos> $A", <start_of_turn>/<end_of_turn>;
    eos <eos>."""

    tok = _sentencepiece_like(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "never")
    tok.post_processor = _bos_first(tok, "<bos>")
    return _save(tok, out, template or trl_template("gemma"), False, bos_token="<bos>", eos_token="<eos>",
                 pad_token="<pad>", unk_token="<unk>")


MISTRAL_TOOL_SPECIALS = ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                         "[/TOOL_RESULTS]"]


def mistral_tools_tokenizer(out: Path, template: str | dict | None = None) -> Path:
    """Mistral v0.3's shape with its tool control tokens ([TOOL_CALLS], [TOOL_RESULTS] ...)."""

    tok = _sentencepiece_like(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", *MISTRAL_TOOL_SPECIALS])
    tok.post_processor = _bos_first(tok, "<s>")
    return _save(tok, out, template or MISTRAL_V3_TEMPLATE, False, bos_token="<s>", eos_token="</s>",
                 unk_token="<unk>")


CHATML_TEMPLATE = (TEMPLATES / "chatml-tools.jinja").read_text()


def chatml_tokenizer(out: Path, template: str | dict | None = CHATML_TEMPLATE) -> Path:
    """A ChatML model (<|im_start|>/<|im_end|>, Hermes-style <tool_call>) whose template carries {% generation %}
    blocks: the mask is transformers' return_assistant_tokens_mask."""
    from tokenizers import processors

    tok = _bpe(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _save(tok, out, template, False, eos_token="<|im_end|>", pad_token="<|endoftext|>")


DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>"]


def deepseek_tokenizer(out: Path, template: str | dict | None = None) -> Path:
    """DeepSeek V3's shape: a byte-level BPE, its chat and tool tokens special, <think>/</think> added; bos written
    by the template; its published template (a tool call's arguments a JSON string)."""
    from tokenizers import AddedToken, processors

    tok = _bpe(QWEN_SPLIT, DEEPSEEK_SPECIALS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return _save(tok, out, template or trl_template("deepseekv3"), False, bos_token="<｜begin▁of▁sentence｜>",
                 eos_token="<｜end▁of▁sentence｜>")


TOOL_CORPUS = ['{"name": "get_weather", "arguments": {"city": "Paris"}} The weather in Paris is sunny, 21 C.',
               "Calling the function get_time for Tokyo: it is 10:00. tool_call parameters"]

# family: (tokenizer builder, the template transformers' assistant mask is computed with, or None: the published
# one has {% generation %} blocks itself)
FAMILIES = {
    "llama3.1": (llama31_tokenizer, lambda: (TEMPLATES / "llama3.1-training.jinja").read_text()),
    "qwen2.5": (qwen25_tokenizer, lambda: trl_template("qwen2_5_training")),
    "qwen3": (qwen3_tokenizer, lambda: (TEMPLATES / "qwen3-training.jinja").read_text()),
    "mistral-v0.3": (mistral_tools_tokenizer, lambda: (TEMPLATES / "mistral-v0.3-training.jinja").read_text()),
    "gemma2": (gemma2_tokenizer, lambda: trl_template("gemma_training")),
    "phi3": (phi3_tokenizer, lambda: trl_template("phi3_training")),
    "chatml": (chatml_tokenizer, lambda: None),
    "deepseek-v3": (deepseek_tokenizer, lambda: trl_template("deepseekv3_training")),
}
