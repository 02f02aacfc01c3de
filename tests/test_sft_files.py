"""The fine-tuning data users have (docs/config-reference.md): every row format (OpenAI messages, with text parts,
TRL prompt/completion standard and conversational, ShareGPT, input/output under configured keys) and every file
type (JSONL, .jsonl.gz, .jsonl.zst, Parquet, Arrow, a datasets save_to_disk directory, a directory or glob of
shards, a list of paths, s3:// on a real S3 server) trains from the same content to the same samples; a row or
a file that is none of them is one line naming it."""

from __future__ import annotations

import gzip
import json

import pytest
from kubetron.contract.errors import ConfigError
from kubetron.data.tokenizer import tokenizer_from_assets

from tests.chat_tokenizers import qwen3_tokenizer, write_jsonl
from tests.sft_rows import QA, assert_same, messages_rows, samples

pytestmark = pytest.mark.unit

CHAT_FORMATS = {
    "messages": messages_rows,
    "content-parts": lambda: [{"messages": [{**m, "content": [{"type": "text", "text": m["content"]}]}
                                            for m in r["messages"]]} for r in messages_rows()],
    "trl-conversational": lambda: [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]}
                                   for r in messages_rows()],
    "sharegpt": lambda: [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[
        m["role"]], "value": m["content"]} for m in r["messages"]]} for r in messages_rows()],
}
PAIR_FORMATS = {  # (rows, dataset keyword arguments)
    "input-output": (lambda: [{"input": q, "output": a} for q, a in QA], {}),
    "configured-keys": (lambda: [{"question": q, "answer": a, "id": n} for n, (q, a) in enumerate(QA)],
                        {"input_key": "question", "output_key": "answer"}),
    "trl-standard": (lambda: [{"prompt": q, "completion": a} for q, a in QA], {}),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tokenizer_from_assets("HuggingFaceTokenizer", str(qwen3_tokenizer(tmp_path_factory.mktemp("tok") / "q")))


def test_every_row_format_trains_from_the_same_content_to_the_same_samples(tok, tmp_path):
    reference = samples(str(write_jsonl(tmp_path / "ref.jsonl", messages_rows())), tok)
    assert any(s["loss_mask"].sum() for s in reference)
    for name, rows in CHAT_FORMATS.items():
        assert_same(samples(str(write_jsonl(tmp_path / f"{name}.jsonl", rows())), tok), reference)
    pairs = samples(str(write_jsonl(tmp_path / "pairs.jsonl", PAIR_FORMATS["input-output"][0]())), tok)
    for name, (rows, kw) in PAIR_FORMATS.items():
        assert_same(samples(str(write_jsonl(tmp_path / f"{name}.jsonl", rows())), tok, **kw), pairs)


def _write(path, rows: list[dict], kind: str):
    """`rows` as a file of `kind`, written by the library users write it with."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "jsonl":
        write_jsonl(path, rows)
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif kind == "jsonl.zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    elif kind == "arrow":
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table, max_chunksize=4)
    elif kind == "save_to_disk":
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=2)
    return path


FILE_KINDS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "save_to_disk")


def _shards(root, rows: list[dict]):
    """The rows in four shards of four kinds: a directory as users get it from a hub or a pipeline."""
    root.mkdir()
    step = (len(rows) + 3) // 4
    for n, kind in enumerate(("jsonl.gz", "parquet", "jsonl.zst", "jsonl")):
        _write(root / f"part-{n}.{kind}", rows[n * step:(n + 1) * step], kind)
    (root / "README.md").write_text("# not data\n")
    return root


def test_every_file_type_trains_from_the_same_content_to_the_same_samples(tok, tmp_path):
    rows = messages_rows()
    reference = samples(str(write_jsonl(tmp_path / "ref.jsonl", rows)), tok)
    for kind in FILE_KINDS:
        path = _write(tmp_path / f"data.{kind}", rows, kind)
        assert_same(samples(str(path), tok), reference)
    shards = _shards(tmp_path / "shards", rows)
    assert_same(samples(str(shards), tok), reference)
    assert_same(samples(str(shards / "part-*"), tok), reference)
    assert_same(samples(sorted(str(p) for p in shards.glob("part-*")), tok), reference)
    assert_same(samples(str(tmp_path / "data.save_to_disk" / "data-0000*-of-00002.arrow"), tok), reference)


def test_data_on_s3_reads_like_local_data(tok, tmp_path, s3_server, monkeypatch):
    """s3:// objects, prefixes (a directory of shards, a save_to_disk directory) and globs, with the endpoint and
    keys from the AWS_* environment as pretraining data reads them (a real S3 server)."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.new_bucket("sft")
    client = s3_server.client()
    rows = messages_rows()
    reference = samples(str(write_jsonl(tmp_path / "ref.jsonl", rows)), tok)
    shards = _shards(tmp_path / "shards", rows)
    local = _write(tmp_path / "hf", rows, "save_to_disk")
    for folder, prefix in ((shards, "data/shards"), (local, "data/hf")):
        for p in folder.iterdir():
            client.upload_file(str(p), bucket, f"{prefix}/{p.name}")
    client.upload_file(str(_write(tmp_path / "one.jsonl.zst", rows, "jsonl.zst")), bucket, "one.jsonl.zst")
    for path in ("one.jsonl.zst", "data/shards", "data/shards/", "data/shards/part-*", "data/hf"):
        assert_same(samples(f"s3://{bucket}/{path}", tok), reference)
    assert_same(samples([f"s3://{bucket}/data/shards/part-0.jsonl.gz", str(shards / "part-1.parquet"),
                         f"s3://{bucket}/data/shards/part-2.jsonl.zst", str(shards / "part-3.jsonl")], tok), reference)
    with pytest.raises(ConfigError, match=rf"s3://{bucket}/nothing: no such object or prefix"):
        samples(f"s3://{bucket}/nothing", tok)


def test_a_row_of_no_known_format_names_its_file_line_keys_and_the_formats(tok, tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", messages_rows()[:2] + [{"text": "Snow is white.", "id": 3}])
    with pytest.raises(ConfigError) as err:
        samples(str(path), tok)
    msg = str(err.value)
    assert msg.startswith(f"finetuning.data_path: {path}:3: keys 'text', 'id' are none of the formats: ")
    for fmt in ("'messages': [{role, content}]} (OpenAI chat)", "{'prompt', 'completion'} (TRL",
                "{'conversations': [{from, value}]} (ShareGPT)", "{'input', 'output'} (finetuning.input_key"):
        assert fmt in msg
    table = _write(tmp_path / "bad.parquet", [{"prompt": "q", "completion": "a"}] * 4 + [{"prompt": "q"}], "parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet row 5: 'prompt' and 'completion' must both be strings"):
        samples(str(table), tok)
    bad = write_jsonl(tmp_path / "parts.jsonl", [{"messages": [{"role": "user", "content": [{"type": "image"}]}]}])
    with pytest.raises(ConfigError, match=r"parts.jsonl:1: 'messages' message 1: content must be a string or a list "
                                          r"of \{type: text, text\} parts"):
        samples(str(bad), tok)
    gz = tmp_path / "broken.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"input": "a", "output": "b"}\n{"input": \n'))
    with pytest.raises(ConfigError, match=r"broken.jsonl.gz:2: not a JSON object"):
        samples(str(gz), tok)


def test_paths_that_hold_no_data_are_named(tok, tmp_path):
    import datasets

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"empty: no data files in it \(.jsonl, .json, .ndjson, .parquet, .arrow"):
        samples(str(tmp_path / "empty"), tok)
    with pytest.raises(ConfigError, match=r"nope\*.jsonl: matches no file"):
        samples(str(tmp_path / "nope*.jsonl"), tok)
    with pytest.raises(ConfigError, match=r"missing.jsonl: no such file or directory"):
        samples(str(tmp_path / "missing.jsonl"), tok)
    one = datasets.Dataset.from_list(messages_rows())
    datasets.DatasetDict({"eval": one, "test": one}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"dd: a datasets DatasetDict with splits eval, test and none named train; "
                                          r"give one split's directory \(e.g. .*dd/eval\)"):
        samples(str(tmp_path / "dd"), tok)
    assert_same(samples(str(tmp_path / "dd" / "eval"), tok), samples(str(write_jsonl(tmp_path / "r.jsonl",
                                                                                      messages_rows())), tok))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"blank.jsonl: holds no examples"):
        samples(str(tmp_path / "blank.jsonl"), tok)
