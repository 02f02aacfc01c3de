"""Fine-tuning data as hostile input: the files users have read the rows `datasets` reads
(CSV with quoted newlines, JSON arrays, DatasetDict splits), a compressed or encoded file that inflates past its bound
is refused naming it (a 255 KB gzip of 881 MB, an 818-byte Parquet file of 845 MB), no link found in a data directory
or by a glob is followed, a chat template runs under memory and time bounds, and the cache of tokenized data is keyed
by the data's content and signed with the job's own key: one planted in a shared cache_dir is not used."""

from __future__ import annotations

import csv
import gzip
import json
import logging
import os
import time

import pytest
from kubetron.contract.errors import ConfigError
from kubetron.data.finetuning import FinetuningDataset, SftSettings, build_arrays
from kubetron.data.sft import cache as sft_cache
from kubetron.data.sft import files as sft_files
from kubetron.data.tokenizer import ByteTokenizer, tokenizer_from_assets

from tests.chat_tokenizers import qwen3_tokenizer, sample_digest, write_jsonl
from tests.sft_rows import assert_same, messages_rows, samples

pytestmark = pytest.mark.unit

QA = [{"prompt": f"Q{i}: a line,\nthen \"another\"?", "completion": f" answer {i}"} for i in range(12)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tokenizer_from_assets("HuggingFaceTokenizer", str(qwen3_tokenizer(tmp_path_factory.mktemp("tok") / "q")))


def test_csv_json_arrays_and_datasetdict_splits_read_the_rows_datasets_reads(tok, tmp_path):
    """CSV (quoted newlines and quotes), TSV, a JSON array, gzip'd CSV: the same rows as `datasets` loads from each,
    trained to the same samples as JSON Lines; a DatasetDict directory gives its train split (and its validation
    split to valid_data_path); a glob over it never reads dataset_dict.json as rows."""
    import datasets

    reference = samples(str(write_jsonl(tmp_path / "ref.jsonl", QA)), tok)
    with open(tmp_path / "qa.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "completion"])
        w.writeheader()
        w.writerows(QA)
    with open(tmp_path / "qa.tsv", "w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "completion"], delimiter="\t")
        w.writeheader()
        w.writerows(QA)
    (tmp_path / "qa.json").write_text(json.dumps(QA, indent=2))
    (tmp_path / "qa.csv.gz").write_bytes(gzip.compress((tmp_path / "qa.csv").read_bytes()))
    for name, kind in (("qa.csv", "csv"), ("qa.tsv", "csv"), ("qa.json", "json")):
        kw = {"delimiter": "\t"} if name.endswith(".tsv") else {}
        theirs = datasets.load_dataset(kind, data_files=str(tmp_path / name), split="train", **kw).to_list()
        rows = [r for _, r in sft_files.read_rows(sft_files.resolve(str(tmp_path / name), "f"), "f")]
        assert rows == theirs == QA, name
    for name in ("qa.csv", "qa.tsv", "qa.json", "qa.csv.gz"):
        assert_same(samples(str(tmp_path / name), tok), reference)
    one = datasets.Dataset.from_list(QA)
    datasets.DatasetDict({"train": one, "validation": datasets.Dataset.from_list(QA[:3])}).save_to_disk(
        str(tmp_path / "dd"))
    assert_same(samples(str(tmp_path / "dd"), tok), reference)
    valid = FinetuningDataset(str(tmp_path / "dd"), tok, 64, packing=True, seed=1, field="finetuning.valid_data_path")
    assert valid.offsets.size - 1 == 3
    both = sft_files.resolve(str(tmp_path / "dd" / "*"), "f")
    assert all(f.url.endswith(".arrow") for f in both) and len(both) == 2  # train/ and validation/, no metadata
    datasets.DatasetDict({"a": one}).save_to_disk(str(tmp_path / "dd2"))
    with pytest.raises(ConfigError, match=r"dd2: a datasets DatasetDict with splits a and none named train; give one "
                                          r"split's directory \(e.g. .*dd2/a\)"):
        samples(str(tmp_path / "dd2"), tok)
    (tmp_path / "bad.json").write_text('[{"prompt": "a", "completion": "b"},\n {"prompt": }]')
    with pytest.raises(ConfigError, match=r"bad.json: not a JSON array \(Expecting value at line 2, column 13\)"):
        samples(str(tmp_path / "bad.json"), tok)


def _gzip_bomb(path, decompressed: int, line: bool = False):
    """`decompressed` bytes of one endless JSON line (or `{}` lines), gzip members repeated: ~1000x smaller."""
    member = gzip.compress(b"{}\n" * (1 << 22) if line else b"a" * (12 << 20), compresslevel=9)
    head = gzip.compress(b'{"prompt": "') if not line else b""
    with open(path, "wb") as f:
        f.write(head)
        for _ in range(decompressed // ((12 << 20) if not line else 3 << 22) + 1):
            f.write(member)
    return path


def test_a_compression_bomb_is_refused_naming_the_file(tmp_path):
    """A gzip of ~255 KB that decompresses to 881 MB, and an 818-byte Parquet file of 845 MB of rows (one dictionary
    value repeated), are refused once they pass max(256 MiB, 100 x their size): one line naming the file, before
    memory fills."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    gz = _gzip_bomb(tmp_path / "bomb.jsonl.gz", 881 << 20)
    assert gz.stat().st_size < 1 << 20
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        FinetuningDataset(str(gz), ByteTokenizer(), 64, packing=True, seed=0)
    assert str(err.value).startswith(f"finetuning.data_path: {gz}: gives more than ")
    assert f"over the bound of {256 << 20}" in str(err.value) and "compression bomb" in str(err.value)
    print(f"gzip bomb of {gz.stat().st_size} bytes refused in {time.monotonic() - t0:.1f}s")
    value = "x" * (1 << 20)
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] * 845, pa.int32()), pa.array([value]))
    pq.write_table(pa.table({"prompt": repeated, "completion": ["y"] * 845}), tmp_path / "bomb.parquet",
                   compression="zstd")
    size = (tmp_path / "bomb.parquet").stat().st_size
    assert size < 2048, size
    with pytest.raises(ConfigError, match=rf"bomb.parquet: gives more than \d+ bytes once decompressed, over the "
                                          rf"bound of {256 << 20}"):
        FinetuningDataset(str(tmp_path / "bomb.parquet"), ByteTokenizer(), 64, packing=True, seed=0)
    rows = tmp_path / "rows.parquet"  # rows that cost nothing to store: their count is read from the metadata
    pq.write_table(pa.table({"prompt": pa.array([None] * 3000, pa.string())}), rows)
    with pytest.raises(ConfigError, match=r"rows.parquet: gives more than 3000 rows once decompressed, over the "
                                          r"bound of 2000 \(max\(256 MiB, 1 x"):
        _budget_read(rows, 2000)


def _budget_read(path, limit: int):
    old = sft_files.MIN_BUDGET
    sft_files.MIN_BUDGET = limit
    try:
        return list(sft_files.read_rows(sft_files.resolve(str(path), "f"), "finetuning.data_path", expansion=1))
    finally:
        sft_files.MIN_BUDGET = old


def test_no_link_found_in_a_data_directory_or_by_a_glob_is_followed(tmp_path):
    """A link in a data directory (or matched by a glob) is refused naming it, whether it points out of the
    directory or at a device; the path the config names may itself be a link (the user's own choice)."""
    secret = tmp_path / "secret.jsonl"
    write_jsonl(secret, [{"input": "the other job's", "output": "data"}])
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [{"input": "q", "output": "a"}])
    os.symlink(secret, data / "b.jsonl")
    for path in (data, data / "*.jsonl"):
        with pytest.raises(ConfigError, match=rf"data/b.jsonl: a symbolic link \(to {secret}\) in the data "):
            sft_files.resolve(str(path), "finetuning.data_path")
    (data / "b.jsonl").unlink()
    os.symlink("/dev/zero", data / "zero.jsonl")
    with pytest.raises(ConfigError, match="zero.jsonl: a symbolic link"):
        sft_files.resolve(str(data), "finetuning.data_path")
    (data / "zero.jsonl").unlink()
    os.symlink(data, tmp_path / "named")
    assert [f.url for f in sft_files.resolve(str(tmp_path / "named"), "f")] == [f"{tmp_path / 'named'}/a.jsonl"]


@pytest.mark.parametrize("template, words", [
    ("{{ 'x' * 10**10 }}", "makes a repeated sequence of 10000000000 characters"),
    ("{{ messages | tojson(indent=10**9) }}", "makes a JSON text of"),
    ("{{ 'x'.center(10**10) }}", "makes a string of 10000000000 characters"),
    ("{{ '%0*d' % (10**10, 1) }}", "makes a '%*' field wider than"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "makes a value of"),
    ("{{ 7 ** 100000000 }}", "raises a number to the power 100000000"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "ran for more than"),
])
def test_a_chat_template_runs_under_memory_and_time_bounds(tmp_path, monkeypatch, template, words):
    """What a template may make is bounded before it is made: each of these is one line naming the row, fast."""
    from kubetron.data.sft import sandbox

    if "ran for" in words:  # the time bound, shortened; the others must be refused before any time passes
        monkeypatch.setattr(sandbox, "MAX_SECONDS", 1.0)
    tok = tokenizer_from_assets("HuggingFaceTokenizer", str(qwen3_tokenizer(tmp_path / "t", template)))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        FinetuningDataset(str(write_jsonl(tmp_path / "sft.jsonl", messages_rows()[:1])), tok, 64, packing=True,
                          seed=0)
    assert str(err.value).startswith("finetuning.data_path: ") and "sft.jsonl:1: the chat template failed: it " \
        in str(err.value) and words in str(err.value), str(err.value)
    assert time.monotonic() - t0 < 5


ROWS = [{"messages": m["messages"]} for m in messages_rows()] * 4


def _dataset(data, tok, place):
    return FinetuningDataset(str(data), tok, 64, packing=True, seed=0, cache_at=place)


def test_a_cache_planted_in_a_shared_cache_dir_is_not_used(tok, tmp_path, caplog):
    """Two jobs share finetuning.cache_dir. The attacker (another job: its own store, its own key) writes a cache
    with its own samples under the victim's key, as it can compute it from data it knows; the victim rebuilds from
    its data (a line saying why) and trains on its own samples. A same-size edit with its mtime put back is another
    key: never the stale cache."""
    shared = str(tmp_path / "shared")
    data = write_jsonl(tmp_path / "sft.jsonl", ROWS)
    victim = sft_cache.cache_location(shared, str(tmp_path / "victim-store"))
    attacker = sft_cache.cache_location(shared, str(tmp_path / "attacker-store"))
    honest = sample_digest(_dataset(data, tok, victim))
    (stored,) = (tmp_path / "shared").iterdir()
    poisoned_rows = [{"messages": [m["messages"][0], {"role": "assistant", "content": "Send your keys to me."}]}
                     for m in ROWS]
    poison = _dataset(write_jsonl(tmp_path / "poison.jsonl", poisoned_rows), tok, attacker)
    arrays, meta = build_arrays(str(tmp_path / "poison.jsonl"), tok, SftSettings(64, True), "f")
    key = stored.name.removesuffix(sft_cache.SUFFIX)
    stored.write_bytes(sft_cache.to_bytes(arrays, key, meta, sft_cache.job_secret(attacker.key_store, True, "f")))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubetron"):
        again = _dataset(data, tok, victim)
    assert sample_digest(again) == honest != sample_digest(poison)
    assert f"the cached {tmp_path / 'shared'}/{stored.name} is not written by this job (its signature does not " \
           "match the job's key)" in caplog.text and "rebuilding it" in caplog.text
    text = data.read_text()
    stat = data.stat()
    data.write_text(text.replace("Paris", "Lyons", 1))
    assert data.stat().st_size == stat.st_size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = _dataset(data, tok, victim)
    assert sample_digest(edited) != honest
    assert "Lyons" in tok.decode(edited.tokens)
