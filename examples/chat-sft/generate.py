"""Greedy chat generation with `transformers` from an HF model directory, through its chat template, with tools.

    python examples/chat-sft/generate.py HF_DIR "question"

The question is one user turn; the get_weather tool is offered (as in the training chats); the model's reply is
printed as it wrote it, tool call included.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def main(hf_dir: str, question: str) -> None:
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tools = [WEATHER] if "weather" in question else None
    chat = [{"role": "user", "content": question}] if tools else [
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": question}]
    ids = tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    print(f"{question!r} -> {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
