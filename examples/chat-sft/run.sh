#!/usr/bin/env bash
# Chat fine-tuning with tool calls, end to end on CPU (under two minutes): a tiny random chat model with its own
# tokenizer and chat template -> import-hf -> inspect-data (the tokens and what is trained) -> packed SFT on
# chats.jsonl -> export-hf -> transformers chats with the result. Needs `transformers` (pip install -e '.[hf]').
# Run from the repository root. ITERS=N trains N iterations instead of the config's 120.
set -euo pipefail
W=${W:-/tmp/kubetron-chat-sft}
PY=${PY:-python}
ITERS=${ITERS:-120}
rm -rf "$W" && mkdir -p "$W"
paths=(tokenizer.tokenizer_model="$W/hf" checkpoint.pretrained_checkpoint="$W/imported" checkpoint.save="$W/run"
       train.train_iters="$ITERS" checkpoint.save_interval="$ITERS" scheduler.lr_warmup_iters=$((ITERS / 10)))
$PY examples/chat-sft/make_model.py "$W/hf"
$PY -m kubetron import-hf "$W/hf" "$W/imported" > /dev/null   # prints the model section (sft.yaml has it)
$PY -m kubetron inspect-data --config examples/chat-sft/sft.yaml "${paths[@]}" --limit 2
$PY -m kubetron finetune --config examples/chat-sft/sft.yaml "${paths[@]}"
$PY -m kubetron export-hf "$W/run" "$W/hf-tuned"
$PY examples/chat-sft/generate.py "$W/hf" "What is the weather in Oslo?"        # before: random tokens
$PY examples/chat-sft/generate.py "$W/hf-tuned" "What is the weather in Oslo?"  # after: a get_weather call
$PY examples/chat-sft/generate.py "$W/hf-tuned" "What color is grass?"
