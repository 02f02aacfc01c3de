"""Fine-tuning data, from the files users bring to the samples a run trains on (used by kubetron.data.finetuning).

* :mod:`kubetron.data.sft.files` - paths, directories, globs, lists, s3:// -> files -> rows (JSONL plain/gz/zst,
  Parquet, Arrow, datasets' save_to_disk)
* :mod:`kubetron.data.sft.rows` - a row (OpenAI messages, TRL prompt/completion, ShareGPT, input/output) -> a chat
  or a prompt/answer pair
* :mod:`kubetron.data.sft.chat` - chat templates rendered as transformers renders them; the spans trained on
* :mod:`kubetron.data.sft.encode` - examples -> ids and answer flags, in batches, with progress
* :mod:`kubetron.data.sft.cache` - the tokenized and packed data, built once by rank 0 and reused
"""
