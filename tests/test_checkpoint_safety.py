"""A checkpoint is data, never code, and a store's links are never followed, whoever wrote it (docs/security.md).

Every format kubetron reads gets crafted files: a pickle whose unpickling creates a marker file, a torch DCP
entry recorded as bytes with a forged size (DCP would torch.load it with weights_only=False), bytes placed
outside the checkpoint, compressed records (what a zip bomb is made of), byte ranges beyond their file and
indexes of absurd size. Each is refused with one line (a CheckpointError; the CLI's `checkpoint error: ...`,
exit 1) and the marker never appears, on a resume (`checkpoint.load`) and through
`checkpoint.pretrained_checkpoint`. Links planted in a store (to a file holding a secret, to /proc/self/environ,
to a directory) are refused where a checkpoint file would be read, and ignored where they stand for a
checkpoint directory; the secret never reaches a new checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from kubetron.contract import exitcodes
from kubetron.contract.errors import CheckpointError

from tests.ckpt_utils import MODEL, Payload, kubetron_parts, megatron_gpt, write_megatron_lm
from tests.inprocess import in_process_config
from tests.trainer_utils import TINY, run

pytestmark = pytest.mark.unit

pytest.importorskip("megatron.core")

EMBEDDING = "embedding.word_embeddings.weight"
SECRET = "fake-secret-4f1d9c"


def save_checkpoint(root: Path, fmt: str, iteration: int = 3) -> Path:
    """A checkpoint of `fmt` saved by kubetron's CheckpointManager in this process; its iter_ directory."""
    model, ckpt = kubetron_parts(f"checkpoint.save={root}", f"checkpoint.ckpt_format={fmt}",
                                 "checkpoint.async_save=false")
    ckpt.train_state.step = iteration
    ckpt.save(iteration)
    ckpt.close()
    return root / f"iter_{iteration:07d}"


def refused(location: Path, how: str, marker: Path | None = None) -> str:
    """Load `location` as `how` (resume: checkpoint.load; pretrained: checkpoint.pretrained_checkpoint);
    it must be refused with one line, and the marker (if any) must not exist. Returns the line."""
    key = "checkpoint.load" if how == "resume" else "checkpoint.pretrained_checkpoint"
    _, ckpt = kubetron_parts(f"{key}={location}")
    with pytest.raises(CheckpointError) as e:
        ckpt.load(finetune=how == "pretrained")
    if marker is not None:
        assert not marker.exists(), "code from the checkpoint ran"
    line = str(e.value)
    assert "\n" not in line and len(line) < 600, line
    return line


def deflated(data: bytes) -> bytes:
    """The same torch.save zip with every record deflated: torch.load reads it, and such a record of a few
    KB can inflate to gigabytes."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


def pickled_payload(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"iteration": Payload(marker)}, buf)
    return buf.getvalue()


def test_the_payloads_are_live(tmp_path):
    """What these tests plant does what they say when loaded the unsafe way (so a pass means it was refused)."""
    marker = tmp_path / "ran"
    torch.load(io.BytesIO(pickled_payload(marker)), weights_only=False)
    assert marker.exists()
    t = torch.arange(10.0)
    buf = io.BytesIO()
    torch.save(t, buf)
    assert torch.equal(torch.load(io.BytesIO(deflated(buf.getvalue())), weights_only=True), t)


# -- torch_dist: kubetron's own (dist/) on resume, Megatron-LM's (iter_N/ itself) as the pretrained checkpoint --

def dist_checkpoint(tmp_path: Path, how: str) -> tuple[Path, Path]:
    """(location to load, the torch DCP directory in it)."""
    if how == "resume":
        it = save_checkpoint(tmp_path / "ckpt", "torch_dist")
        return tmp_path / "ckpt", it / "dist"
    write_megatron_lm(megatron_gpt(seed=1), tmp_path / "megatron", 10, tmp_path / "args-ran")
    return tmp_path / "megatron", tmp_path / "megatron" / "iter_0000010"


def forge(dcp: Path, tmp_path: Path, how: str) -> tuple[str, Path]:
    """Rewrite the DCP `.metadata` so that the word embedding is read in a hostile way; (what the refusal
    says, the marker a payload would create)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = pickle.loads((dcp / ".metadata").read_bytes())  # the test's own file: trusted here
    index = next(k for k in md.storage_data if k.fqn == EMBEDDING)
    info = md.storage_data[index]
    chunk = (dcp / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    marker = tmp_path / "PWNED"
    if how == "bytes-entry":  # the exploit: passes a shape check, DCP unpickles it with weights_only=False
        entry = BytesStorageMetadata()
        entry.size = md.state_dict_metadata[EMBEDDING].size
        md.state_dict_metadata[EMBEDDING] = entry
        payload = pickled_payload(marker)
        (dcp / "__7_0.distcp").write_bytes(payload)
        del md.storage_data[index]
        md.storage_data[MetadataIndex(EMBEDDING)] = _StorageInfo("__7_0.distcp", 0, len(payload))
        expect = f"refusing to load {EMBEDDING}: a BytesStorageMetadata entry is no tensor"
    elif how == "outside":  # the same tensor bytes, in a file outside the checkpoint
        (tmp_path / "outside.distcp").write_bytes(chunk)
        md.storage_data[index] = _StorageInfo(os.path.relpath(tmp_path / "outside.distcp", dcp), 0, len(chunk))
        expect = "not a .distcp file of this checkpoint"
    elif how == "compressed":
        packed = deflated(chunk)
        (dcp / "__7_0.distcp").write_bytes(packed)
        md.storage_data[index] = _StorageInfo("__7_0.distcp", 0, len(packed))
        expect = "is compressed or lies outside the file"
    else:  # "beyond": a byte range past the end of its file
        md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, 1 << 40)
        expect = f"the bytes of {EMBEDDING} at [0, 0] ('__0_0.distcp', {info.offset}, {1 << 40}: file, offset, " \
                 "length) are not inside a .distcp file"
    (dcp / ".metadata").write_bytes(pickle.dumps(md))
    return expect, marker


@pytest.mark.parametrize("how", ["resume", "pretrained"])
@pytest.mark.parametrize("craft", ["bytes-entry", "outside", "compressed", "beyond"])
@pytest.mark.trainer
def test_torch_dist_crafted_metadata_is_refused(tmp_path, how, craft):
    location, dcp = dist_checkpoint(tmp_path, how)
    expect, marker = forge(dcp, tmp_path, craft)
    line = refused(location, how, marker)
    assert expect in line, line


@pytest.mark.trainer
def test_torch_dist_state_keys_are_checked_before_anything_is_allocated(tmp_path):
    """kubetron's common.pt names the optimizer states to read; one it never writes is refused (a list of a
    million names would allocate a million copies of the model)."""
    it = save_checkpoint(tmp_path / "ckpt", "torch_dist")
    common = torch.load(it / "common.pt", weights_only=True)
    common["dist_optimizer"]["state_keys"] = [f"s{i}" for i in range(10**6)]
    torch.save(common, it / "common.pt")
    assert "not an optimizer state kubetron wrote" in refused(tmp_path / "ckpt", "resume")


# -- every .pt kubetron reads: only tensors and plain data, only a stored (uncompressed) torch.save zip ---------

PT_FILES = {"common.pt": "iter_0000003/common.pt", "tracker": "latest_train_state.pt",
            "rng": "iter_0000003/rng/rank_00000.pt", "model.pt": "iter_0000003/model.pt",
            "optim.pt": "iter_0000003/optim.pt"}


@pytest.mark.parametrize("craft", ["pickle", "compressed"])
@pytest.mark.parametrize("file", sorted(PT_FILES))
def test_every_pt_file_is_read_as_data_only(tmp_path, file, craft):
    save_checkpoint(tmp_path / "ckpt", "kubetron")
    path = tmp_path / "ckpt" / PT_FILES[file]
    marker = tmp_path / "PWNED"
    path.write_bytes(pickled_payload(marker) if craft == "pickle" else deflated(path.read_bytes()))
    line = refused(tmp_path / "ckpt", "resume", marker)
    assert f"refusing to load {PT_FILES[file]}" in line, line
    assert ("could run code" if craft == "pickle" else "is compressed") in line, line


@pytest.mark.parametrize("how", ["resume", "pretrained"])
def test_kubetron_format_entry_that_is_not_a_tensor_is_refused(tmp_path, how):
    it = save_checkpoint(tmp_path / "ckpt", "kubetron")
    weights = torch.load(it / "model.pt", weights_only=True)
    torch.save({**weights, EMBEDDING: "not a tensor"}, it / "model.pt")
    assert f"{EMBEDDING}: the checkpoint holds str" in refused(tmp_path / "ckpt", how)


# -- the sharded format's JSON index ---------------------------------------------------------------------------

def edit_index(it: Path, change) -> None:
    path = it / "shards" / "rank_00000.json"
    index = json.loads(path.read_text())
    change(index, next(e for e in index["pieces"] if e["name"] == f"model/{EMBEDDING}"))
    path.write_text(json.dumps(index))


def _split_overlapping(index: dict, e: dict) -> None:
    """The piece `e` as two pieces of the same top half, each with its own bytes: they add up to the tensor, and
    overlap."""
    (r0, r1), rest = e["box"][0], e["box"][1:]
    half = (r1 - r0) // 2
    assert half * 2 == r1 - r0, e["box"]
    nbytes = e["nbytes"] // 2
    e.update(box=[[r0, r0 + half], *rest], nbytes=nbytes)
    index["pieces"].append({**e, "offset": e["offset"] + nbytes})


SHARDED_CRAFTS = {
    # a dtype is looked up by name: getattr(torch, "load") is a function
    "dtype": (lambda index, e: e.update(dtype="load"), "is not a tensor piece"),
    # a declared size that disagrees with dtype x numel (a terabyte to read)
    "nbytes": (lambda index, e: e.update(nbytes=1 << 40), "its box of float32 holds 32768"),
    # a byte range beyond the file (size consistent with the box)
    "offset": (lambda index, e: e.update(offset=1 << 40), "the object holds"),
    # two pieces sharing bytes
    "overlap": (lambda index, e: e.update(offset=index["pieces"][1]["offset"]), "overlaps another piece's bytes"),
    # two pieces of one tensor whose boxes overlap, adding up to it: the rows neither covers would keep their values
    "boxes": (lambda index, e: _split_overlapping(index, e), "the pieces of model/"),
    # a box outside the tensor's global shape
    "box": (lambda index, e: e.update(box=[[0, 10**9], [0, 64]]), "is not inside"),
    # values must be plain data
    "values": (lambda index, e: index["values"].update({"optim/x/y": {"nested": [1]}}), "not a plain optimizer value"),
}


@pytest.mark.parametrize("how", ["resume", "pretrained"])
@pytest.mark.parametrize("craft", sorted(SHARDED_CRAFTS))
def test_sharded_index_is_checked_before_anything_is_read(tmp_path, how, craft):
    it = save_checkpoint(tmp_path / "ckpt", "sharded")
    change, expect = SHARDED_CRAFTS[craft]
    edit_index(it, change)
    line = refused(tmp_path / "ckpt", how)
    assert expect in line, line


@pytest.mark.parametrize("shape", [(4096, 512), (1, 1 << 21), (3, 5, 7)])
def test_the_overlap_check_passes_what_kubetron_writes_and_finds_two_pieces_that_meet(shape):
    """The pieces a flat shard of 4096 ranks makes of a tensor (flat_boxes: part rows, whole rows) meet no other, and
    are checked quickly (a sweep); move one piece onto its neighbour and the pair is named; a crafted set that
    would take too many comparisons is refused."""
    from kubetron.checkpoint import format_sharded

    total = 1
    for n in shape:
        total *= n
    cuts = [total * r // 4096 for r in range(4097)]
    boxes = [box for r in range(4096) for box, _, _ in format_sharded.flat_boxes(shape, cuts[r], cuts[r + 1])]
    assert format_sharded._overlapping(boxes) is None
    moved = [*boxes[:-1], boxes[-2]]
    assert format_sharded._overlapping(moved) is not None


def test_the_overlap_check_refuses_a_crafted_set_it_cannot_afford(monkeypatch):
    from kubetron.checkpoint import format_sharded

    monkeypatch.setattr(format_sharded, "OVERLAP_TESTS", 1000)
    staircase = [[(i, 1000), (i, i + 1)] for i in range(100)]  # disjoint columns, each reaching past every start
    with pytest.raises(CheckpointError, match="pairs of pieces of one tensor to compare"):
        format_sharded._overlapping(staircase)
    assert format_sharded._overlapping(staircase[:40]) is None  # 780 comparisons: affordable


def test_sharded_index_of_absurd_size_is_refused_before_it_is_read(tmp_path):
    it = save_checkpoint(tmp_path / "ckpt", "sharded")
    with open(it / "shards" / "rank_00000.json", "r+b") as f:
        f.truncate(300 << 20)  # sparse: 300 MiB that cost no disk
    assert "more than the 268435456 bytes such a file may hold" in refused(tmp_path / "ckpt", "resume")


def test_run_config_yaml_is_read_as_plain_yaml(tmp_path, caplog):
    """run_config.yaml only names what a resume changes: a python tag in it never runs, the resume goes on
    and says the file was not read."""
    it = save_checkpoint(tmp_path / "ckpt", "sharded")
    marker = tmp_path / "PWNED"
    (it / "run_config.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    _, ckpt = kubetron_parts(f"checkpoint.load={tmp_path / 'ckpt'}")
    assert ckpt.load() == 3
    assert not marker.exists()
    assert "run_config.yaml: not read" in caplog.text


# -- the CLI: one line, the checkpoint error's exit code, nothing run ------------------------------------------

@pytest.mark.process
def test_cli_default_format_resume_refuses_a_forged_torch_dist_entry(tmp_path):
    """The issue's case end to end: a run with the default format resumes a torch_dist checkpoint (the
    checkpoint picks the format) whose word embedding is a forged bytes entry."""
    store = tmp_path / "ckpt"
    base = ["train", "--config", TINY, f"checkpoint.save={store}", "checkpoint.save_interval=2",
            "validation.eval_interval=null", "scheduler.lr_warmup_iters=0"]
    p = run([*base, "train.train_iters=2", "checkpoint.ckpt_format=torch_dist"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    _, marker = forge(store / "iter_0000002" / "dist", tmp_path, "bytes-entry")
    p = run([*base, "train.train_iters=4", f"checkpoint.load={store}"], tmp_path)
    assert p.returncode == exitcodes.ERROR, p.stderr[-3000:]
    assert not marker.exists(), "the pickle payload ran"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "checkpoint error" in ln]
    assert len(lines) == 1 and f"refusing to load {EMBEDDING}" in lines[0], p.stderr[-3000:]
    assert f"refusing to load {EMBEDDING}" in p.termination["message"]


@pytest.mark.process
def test_cli_pretrained_megatron_checkpoint_with_a_forged_entry_is_refused(tmp_path):
    dcp = tmp_path / "megatron" / "iter_0000010"
    write_megatron_lm(megatron_gpt(seed=1), tmp_path / "megatron", 10, tmp_path / "args-ran")
    _, marker = forge(dcp, tmp_path, "bytes-entry")
    cfg = {"model": MODEL, "tokenizer": {"tokenizer_type": "null", "vocab_size": 128},
           "train": {"train_iters": 1, "micro_batch_size": 2, "global_batch_size": 2},
           "validation": {"eval_interval": None},
           "checkpoint": {"pretrained_checkpoint": str(tmp_path / "megatron")}}
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))
    p = run(["finetune", "--config", str(tmp_path / "run.yaml")], tmp_path)
    assert p.returncode == exitcodes.ERROR, p.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "args-ran").exists()
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"checkpoint error: iter_0000010/: refusing to load {EMBEDDING}" in p.stderr, p.stderr[-3000:]


# -- links in a store (item 10) --------------------------------------------------------------------------------

LINKED = {"common.pt": "iter_0000003/common.pt", "shard": "iter_0000003/shards/rank_00000.bin",
          "tracker": "latest_train_state.pt", "commit marker": "iter_0000003/metadata.json",
          "rng directory": "iter_0000003/rng"}


@pytest.mark.parametrize("what, how", [(w, h) for w in sorted(LINKED) for h in ("resume", "pretrained")
                                       if (w, h) != ("rng directory", "pretrained")])  # weights only: no RNG read
def test_a_link_where_a_checkpoint_file_belongs_is_refused(tmp_path, what, how):
    """The link leads to the very bytes that were saved, moved out of the store: still refused (a link
    kubetron did not write could as well lead to a secret, which the next checkpoint would carry)."""
    save_checkpoint(tmp_path / "ckpt", "sharded")
    path = tmp_path / "ckpt" / LINKED[what]
    outside = tmp_path / "outside" / path.name
    outside.parent.mkdir()
    shutil.move(path, outside)
    path.symlink_to(outside)
    line = refused(tmp_path / "ckpt", how)
    assert f"{path.name} is a symbolic link" in line, line


def test_the_progress_log_is_never_appended_through_a_link(tmp_path):
    store = tmp_path / "ckpt"
    store.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("not the trainer's\n")
    (store / "progress.txt").symlink_to(precious)
    from kubetron.checkpoint.progress_log import PodFacts, ProgressLog
    from kubetron.events import Started
    from kubetron.storage import open_store

    log = ProgressLog(in_process_config(f"checkpoint.save={store}"), open_store(str(store)), 1, PodFacts(job_id=""))
    with pytest.raises(CheckpointError) as e:
        log(Started(0, 10, 0, 0.0, None))  # (in a run, the listener is then dropped with a warning)
    assert "progress.txt is a symbolic link" in str(e.value)
    assert precious.read_text() == "not the trainer's\n"


def secret_files(root: Path) -> list[str]:
    """The regular files under `root` (no link followed) that hold SECRET."""
    found = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if not path.is_symlink() and SECRET.encode() in path.read_bytes():
                found.append(str(path.relative_to(root)))
    return found


@pytest.fixture(scope="module")
def tokenized_run(tmp_path_factory):
    """A run with a file-based tokenizer (trained here), checkpoints at iterations 2 and 4."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("links")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["a checkpoint is data, never code"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>"])  # the last id: mock data draws the ids below it
    (d / "tok").mkdir()
    tok.save(str(d / "tok" / "tokenizer.json"))
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    args = ["train", "--config", TINY, "checkpoint.save_interval=2", "validation.eval_interval=null",
            "scheduler.lr_warmup_iters=0", "tokenizer.tokenizer_type=HuggingFaceTokenizer",
            f"tokenizer.tokenizer_model={d / 'tok'}"]
    p = run([*args, "train.train_iters=4", f"checkpoint.save={d / 'store'}"], d)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (d / "store" / "iter_0000004" / "tokenizer" / "tokenizer.json").is_file()
    return d, args


def resume(d: Path, store: Path, args: list[str], iters: int):
    return run([*args, f"train.train_iters={iters}", f"checkpoint.save={store}", f"checkpoint.load={store}"], d,
               AWS_SECRET_ACCESS_KEY=SECRET)


@pytest.mark.parametrize("link", ["environ", "directory"])
@pytest.mark.process
def test_a_link_in_the_tokenizer_dir_is_refused_and_the_secret_stays_out(tokenized_run, tmp_path, link):
    """The issue's case: iter_N/tokenizer/ holds a link to /proc/self/environ (the trainer's environment,
    with its AWS_SECRET_ACCESS_KEY) or to a directory holding a secret. The tokenizer's files are copied into
    every later checkpoint, so the resume stops with one line naming the link (leaving a file out would
    silently change the tokenizer); no new checkpoint, the secret nowhere in the store."""
    d, args = tokenized_run
    store = tmp_path / "store"
    shutil.copytree(d / "store", store, symlinks=True)
    tokdir = store / "iter_0000004" / "tokenizer"
    if link == "environ":
        (tokdir / "NOTICE").symlink_to("/proc/self/environ")
    else:
        (tmp_path / "secrets").mkdir()
        (tmp_path / "secrets" / "credentials").write_text(f"aws_secret_access_key = {SECRET}\n")
        (tokdir / "extra").symlink_to(tmp_path / "secrets")
    p = resume(d, store, args, 6)
    assert p.returncode == exitcodes.ERROR, p.stdout[-2000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    name = "NOTICE" if link == "environ" else "extra"
    lines = [ln for ln in p.stderr.splitlines() if "checkpoint error" in ln]
    assert len(lines) == 1 and f"tokenizer/{name} is a symbolic link" in lines[0], p.stderr[-3000:]
    assert not (store / "iter_0000006").exists()
    assert secret_files(store) == []


@pytest.mark.process
def test_a_linked_checkpoint_directory_is_ignored_and_the_secret_stays_out(tokenized_run, tmp_path):
    """iter_0000009 is a link to a complete checkpoint elsewhere (its tokenizer/ carries a secret) and the
    tracker names it: a linked directory is no checkpoint of this store, so the run resumes from its own
    newest (iteration 4), saves on, and no checkpoint it writes holds the secret."""
    d, args = tokenized_run
    store = tmp_path / "store"
    shutil.copytree(d / "store", store, symlinks=True)
    elsewhere = tmp_path / "elsewhere" / "iter_0000009"
    shutil.copytree(store / "iter_0000004", elsewhere)
    (elsewhere / "tokenizer" / "credentials").write_text(f"aws_secret_access_key = {SECRET}\n")
    (store / "iter_0000009").symlink_to(elsewhere)
    torch.save({"iteration": 9}, store / "latest_train_state.pt")
    p = resume(d, store, args, 12)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {store}/iter_0000004 at iteration 4" in p.stdout, p.stdout[-2000:]
    assert "tracker points at iteration 9 which is not complete" in p.stdout + p.stderr
    assert (store / "iter_0000012" / "tokenizer" / "tokenizer.json").is_file()
    assert secret_files(store) == []
    assert (elsewhere / "tokenizer" / "credentials").is_file()  # nothing deleted through the link either


class _Allocates:
    def __reduce__(self):
        return (bytes, (10**12,))  # a terabyte, from a dozen bytes of pickle


def test_dcp_metadata_pickle_allows_only_metadata_classes():
    """The .metadata allow-list names DCP's metadata classes one by one: no function, and no constructor that
    allocates what it is told (builtins.bytes)."""
    from kubetron.checkpoint.format_torch_dist import check_metadata_pickle

    for payload, name in ((_Allocates(), "builtins.bytes"), (Payload("/nonexistent/x"), "io.open")):
        with pytest.raises(CheckpointError) as e:
            check_metadata_pickle(pickle.dumps(payload), "dist/.metadata")
        assert f"{name} is not allowed in checkpoint metadata" in str(e.value)
