#!/usr/bin/env bash
# End to end on CPU (a few minutes): tiny random HF Llama with its own tokenizer -> import-hf -> packed SFT
# (that tokenizer, read from the HF directory) -> export-hf -> transformers generates. Needs `transformers` (pip install -e '.[hf]'). Run from the repository root.
set -euo pipefail
W=${W:-/tmp/kubetron-hf-sft}
PY=${PY:-python}
rm -rf "$W" && mkdir -p "$W"
$PY examples/hf-sft/make_tiny_llama.py "$W/hf"
$PY -m kubetron import-hf "$W/hf" "$W/imported"            # prints the model section (sft.yaml has it)
$PY -m kubetron finetune --config examples/hf-sft/sft.yaml tokenizer.tokenizer_model="$W/hf" \
    checkpoint.pretrained_checkpoint="$W/imported" checkpoint.save="$W/run"
$PY -m kubetron export-hf "$W/run" "$W/hf-tuned"
$PY examples/hf-sft/generate.py "$W/hf" "What color is snow? "        # before: random tokens
$PY examples/hf-sft/generate.py "$W/hf-tuned" "What color is snow? "  # after fine-tuning
$PY examples/hf-sft/generate.py "$W/hf-tuned" "7+3="
