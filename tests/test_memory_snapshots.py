"""Memory snapshots (docs/recovery.md), in process: their files (complete or absent, checked before any byte
is served, at most two a rank, hostile manifests refused), the gang's agreement on the one to load, which pods
hold whose copies and how much memory that takes, and when the default schedule takes one."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
from kubetron.checkpoint import gang, snapshot
from kubetron.contract import recovery
from kubetron.contract.errors import CheckpointError
from kubetron.storage import snapshot_files as sf

from tests.ckpt_utils import write_snapshot as write

pytestmark = pytest.mark.unit


def test_a_snapshot_is_read_only_when_whole_and_unchanged(tmp_path):
    path = write(tmp_path, 20, payload=bytes(range(256)) * 40)
    with sf.OpenSnapshot(path, rank=0, world_size=2) as snap:
        snap.verify()
        assert snap.read("shards/rank_00000.bin", 256, 4) == bytes([0, 1, 2, 3])
        with pytest.raises(CheckpointError, match="expected 4 bytes at offset 10238"):
            snap.read("shards/rank_00000.bin", 10238, 4)  # past its end: refused before a buffer exists
        with pytest.raises(CheckpointError, match="more than the 3"):
            snap.read_all(sf.COMMON_FILE, 3)
        # a rank's own share of a load: a read-only view of the mapped file, the same bytes, the same bounds
        view = snap.mapped("shards/rank_00000.bin", 256, 4)
        assert view.readonly and bytes(view) == bytes([0, 1, 2, 3])
        with pytest.raises(CheckpointError, match="expected 4 bytes at offset 10238"):
            snap.mapped("shards/rank_00000.bin", 10238, 4)
    assert bytes(view) == bytes([0, 1, 2, 3])  # a view still held outlives the snapshot's closing
    # a flipped byte: opened (sizes match), never served
    data = bytearray((path / "shards/rank_00000.bin").read_bytes())
    data[5000] ^= 1
    (path / "shards/rank_00000.bin").write_bytes(bytes(data))
    with sf.OpenSnapshot(path) as snap, pytest.raises(CheckpointError, match="do not match their checksum"):
        snap.verify()
    # a torn write: shorter than its manifest says
    (path / "shards/rank_00000.bin").write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="a torn write"):
        sf.OpenSnapshot(path)
    # another gang's, or another rank's
    other = write(tmp_path / "b", 30, rank=1, world=4)
    with pytest.raises(CheckpointError, match="gang of 4 ranks, this one has 2"):
        sf.OpenSnapshot(other, world_size=2)
    with pytest.raises(CheckpointError, match="holds rank 1's snapshot, not rank 0's"):
        sf.OpenSnapshot(other, rank=0)


def test_a_file_swapped_for_a_link_is_refused(tmp_path):
    path = write(tmp_path, 20)
    (tmp_path / "secret").write_bytes(b"y" * 1000)
    os.unlink(path / "shards/rank_00000.bin")
    os.symlink(tmp_path / "secret", path / "shards/rank_00000.bin")
    with pytest.raises(CheckpointError, match="cannot read snapshot"):
        sf.OpenSnapshot(path)


def test_an_interrupted_write_leaves_nothing_visible_and_at_most_two_exist(tmp_path):
    for it in (10, 20):
        write(tmp_path, it)

    def dies(w):
        w.write_bytes("shards/rank_00000.bin", b"half")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        sf.write_snapshot(tmp_path, lambda f: sf.Manifest(30, 0, 2, f), dies, 30)
    # before writing 30 only the newest complete one was kept; 30 never became visible
    assert sf.iterations(tmp_path) == [20]
    write(tmp_path, 30)
    write(tmp_path, 40)
    assert sf.iterations(tmp_path) == [30, 40] and sorted(p.name for p in tmp_path.iterdir()) == [
        "snap_0000030", "snap_0000040"]
    # what a SIGKILLed writer leaves (its temp directory) is never listed, and is removed at the next start
    (tmp_path / ".snap_0000050.tmp-abc").mkdir()
    assert sf.iterations(tmp_path) == [30, 40]
    sf.remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap_0000030", "snap_0000040"]
    sf.drop_newer(tmp_path, 35)
    assert sf.iterations(tmp_path) == [30]


@pytest.mark.parametrize("manifest, why", [
    (b"{", "not JSON"),
    (b"[]", "not a snapshot manifest"),
    (b"x" * (sf.MAX_MANIFEST + 1), "more than"),
    (dict(files={"../../etc/passwd": {"size": 1, "sha256": ["0" * 64]}}), "bad file entry"),
    (dict(files={"common.pt": {"size": 1 << 50, "sha256": ["0" * 64]}}), "bad file entry"),
    (dict(files={"common.pt": {"size": sf.CHUNK + 1, "sha256": ["0" * 64]}}), "no digest per"),
    (dict(rank=2, worldSize=2), "not a snapshot manifest"),
    (dict(iteration=True), "not a snapshot manifest"),
])
def test_a_hostile_manifest_is_refused_in_one_line(manifest, why):
    if isinstance(manifest, dict):
        manifest = json.dumps({"format": sf.FORMAT, "chunk": sf.CHUNK, "iteration": 1, "rank": 0, "worldSize": 2,
                               "files": {}, **manifest}).encode()
    with pytest.raises(CheckpointError, match=why):
        sf.parse_manifest(manifest, "m")


# -- the agreement -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reports, expected", [
    # every rank has its own: the newest common one, each from itself
    ([[(0, 10), (0, 20)], [(1, 10), (1, 20)]], (20, (0, 1))),
    # rank 1 was killed writing 20: both load 10
    ([[(0, 10), (0, 20)], [(1, 10)]], (10, (0, 1))),
    # rank 1's pod is new (nothing of its own): rank 0's pod holds its copy of 20
    ([[(0, 10), (0, 20), (1, 20)], []], (20, (0, 0))),
    # its own snapshot wins over a copy; of several copies, the lowest rank's
    ([[(0, 20), (1, 20), (3, 20)], [(1, 20)], [(2, 20), (3, 20)], [(3, 20)]], (20, (0, 1, 2, 3))),
    ([[(0, 20), (2, 20)], [(1, 20), (2, 20)], []], (20, (0, 1, 0))),
    # nothing covers rank 2
    ([[(0, 20)], [(1, 20)], []], None),
    ([[], []], None),
    # entries of ranks outside the gang are ignored
    ([[(0, 5), (7, 5)], [(1, 5)]], (5, (0, 1))),
])
def test_the_gang_agrees_on_the_newest_iteration_every_rank_has(reports, expected):
    got = gang.agree(reports, len(reports))
    assert (got and (got.iteration, got.sources)) == expected
    if got:
        assert got.loaded_from == (recovery.MEMORY if got.sources == tuple(range(len(reports))) else recovery.PEER)


def test_why_the_gang_does_not_load_from_memory():
    assert gang.why_not([[], []], 2) == "no snapshot in the pods' memory"
    assert gang.why_not([[(0, 20)], []], 2) == "no snapshot of rank(s) 1 in any pod's memory"
    assert gang.why_not([[(0, 20)], [(1, 10)]], 2) == (
        "no iteration whose snapshot every rank has (newest per rank: 0: 20, 1: 10)")


def test_a_pod_serves_its_own_snapshots_and_its_copies_of_this_gang_only(tmp_path):
    write(sf.own_dir(tmp_path, 1), 20, rank=1)
    write(sf.own_dir(tmp_path, 1), 30, rank=1)
    write(sf.peer_dir(tmp_path, 0), 30, rank=0)  # the previous pod's rank 0
    write(sf.peer_dir(tmp_path, 3), 30, rank=3, world=4)  # of a gang of another size: not served
    write(sf.peer_dir(tmp_path, 2), 30, rank=0)  # a copy under another rank's name: not served
    assert sorted(gang.holdings(tmp_path, 1, 2)) == [(0, 30), (1, 20), (1, 30)]
    assert gang._decode(gang._encode([(1, 20), (0, 30)])) == [(1, 20), (0, 30)]


def test_the_exchange_frames_survive_any_bytes():
    files = {"a/b.json": b"{}", "c": bytes(range(256)), "d": b""}
    assert gang._unframe(gang._frame(files)) == files


# -- who holds whose copies, and the memory it takes -----------------------------------------------------


def test_replication_is_a_ring_by_default_with_megatrons_factor_and_jump():
    assert [recovery.holders(p, 4) for p in range(4)] == [[1], [2], [3], [0]]
    assert [recovery.held_by(p, 4) for p in range(4)] == [[3], [0], [1], [2]]
    assert recovery.holders(0, 8, factor=3, jump=2) == [2, 4]
    assert recovery.holders(0, 2, factor=5) == [1]  # no more copies than pods
    assert recovery.holders(0, 1) == [] and recovery.held_by(0, 1) == []
    # 2 snapshots of each own rank + 2 of each rank held for another pod, 10% headroom
    assert recovery.volume_bytes(1e9, 8, 4) == int(2 * 2 * 8 * 1e9 * 1.1)
    assert recovery.volume_bytes(1e9, 8, 1) == int(2 * 8 * 1e9 * 1.1)
    assert recovery.volume_bytes(10, 1, 2) == recovery.VOLUME_FLOOR


@pytest.mark.parametrize("data, ok", [
    ({"loadedFrom": "peer", "iteration": 20, "seconds": 1.5, "reason": "", "failed": False, "restart": 1}, True),
    ({"loadedFrom": "disk", "iteration": 20, "seconds": 1.5, "restart": 1}, False),
    ({"loadedFrom": "store", "iteration": -1, "seconds": 1.5, "restart": 1}, False),
    ({"loadedFrom": "store", "iteration": 3, "seconds": float("nan"), "restart": 0}, False),
    ([], False),
])
def test_the_trainers_recovery_report_is_read_checked(data, ok):
    assert (recovery.parse_trainer_recovery(data) is not None) is ok


@pytest.mark.parametrize("iteration, failed, restart, reported", [
    (0, False, 0, False),  # a first start afresh: nothing to recover
    (0, True, 0, True),  # snapshots that failed their checks, the store empty: started afresh, and says so
    (0, False, 2, True),  # an in-place restart that found nothing to load
    (12, False, 0, True),
    (None, False, 1, False),  # not resumed yet
])
def test_which_starts_the_trainer_reports_as_a_recovery(iteration, failed, restart, reported):
    report = gang.Recovery(recovery.STORE, iteration, 0.25, "why", failed).report(restart)
    assert (report is not None) is reported
    if report is not None:
        assert recovery.parse_trainer_recovery(report) == report  # what the operator reads back


# -- when snapshots are taken by default -----------------------------------------------------------------


@pytest.mark.parametrize("stride", [1, 5])
def test_the_default_schedule_keeps_snapshots_within_two_percent_of_the_step_time(tmp_path, monkeypatch, stride):
    """`stride` 5: a loop whose iteration counter other work advances too (bench/loop_overhead.py interleaves its
    variants on one model): the schedule counts this loop's own iterations, so it pays what a run pays."""
    clock = iter(i * 0.1 for i in range(1000))  # an iteration every 100 ms
    monkeypatch.setattr(snapshot.time, "perf_counter", lambda: next(clock))
    snaps = snapshot.MemorySnapshots(tmp_path, 0, 1, interval=None, count_background=False)
    snaps.resumed(40)
    due = []
    for n in range(1, 40):
        if snaps.due(40 + n * stride):
            due.append(n)
            snaps.blocked = 0.0115  # what taking it blocked the loop for
            snaps.taken += 1
    # the first two iterations measure the step; then a snapshot blocking 11.5 ms costs <= 2% of 100 ms each 6 steps,
    # from the first on (its cost unknown when it was taken, the second is not taken at once)
    assert due == [2, 8, 14, 20, 26, 32, 38]
    snaps.close()


def test_one_rank_opens_its_agreed_snapshot_as_a_store_or_says_why_not(tmp_path):
    """The collective steps on a gang of one: what the store-side loading reads comes from the snapshot."""
    payload = bytes(range(256)) * 8
    write(sf.own_dir(tmp_path, 0), 20, world=1, payload=payload)
    got = gang.open_gang(tmp_path, 0, 1, newer_than=10)
    assert got.store is not None and got.store.agreement.loaded_from == recovery.MEMORY
    with got.store as store:
        assert store.read_ranges([("iter_0000020/shards/rank_00000.bin", 300, 5)]) == [payload[300:305]]
        assert store.read_bytes("iter_0000020/common.pt") == b"common"
        assert store.read_bytes("iter_0000020/rng/rank_00000.pt") == b"rng" and not store.exists("iter_0000020/x")
    assert gang.open_gang(tmp_path, 0, 1, newer_than=30).reason == (
        "the snapshots' iteration 20 is older than the store's 30")
    bin_file = sf.own_dir(tmp_path, 0) / "snap_0000020/shards/rank_00000.bin"
    bin_file.write_bytes(b"\xff" + payload[1:])
    got = gang.open_gang(tmp_path, 0, 1, newer_than=None)
    assert got.store is None and got.failed and "do not match their checksum" in got.reason


def test_a_run_loads_only_its_own_snapshots_from_a_directory_another_run_left_them_in(tmp_path, caplog):
    """A snapshot names the run that wrote it (its job, without the attempt, and checkpoint.save): a fresh run
    in a directory another job (or another checkpoint.save) left snapshots in starts from its own store, and
    the other's stay where they are (the composition root hands in the job without its attempt: a new attempt of
    the same job is the same run)."""
    ck = lambda save: SimpleNamespace(checkpoint=SimpleNamespace(  # noqa: E731
        non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir=str(tmp_path), non_persistent_save_interval=5,
        save=save))
    mine = snapshot.open_snapshots(ck("/ckpt/a"), 0, 1, job="team-a/gpt")
    assert snapshot.open_snapshots(ck("/ckpt/b"), 0, 1, job="team-a/gpt").run != mine.run  # another store
    theirs = snapshot.open_snapshots(ck("/ckpt/a"), 0, 1, job="team-b/gpt").run
    assert theirs != mine.run  # another job, even with the same store path

    write(sf.own_dir(tmp_path, 0), 40, world=1, run=theirs)
    with caplog.at_level(logging.INFO, logger="kubetron"):
        got = gang.open_gang(tmp_path, 0, 1, newer_than=None, run=mine.run)
    assert got.store is None and got.reason == "no snapshot in the pods' memory"
    assert "memory snapshots of another run ignored" in caplog.text and "snap_0000040" in caplog.text
    write(sf.own_dir(tmp_path, 0), 20, world=1, run=mine.run)
    got = gang.open_gang(tmp_path, 0, 1, newer_than=None, run=mine.run)
    assert got.store is not None and got.store.agreement.iteration == 20  # its own, not the newer foreign 40
    got.store.close()
    got = gang.open_gang(tmp_path, 0, 1, newer_than=None, run=theirs)
    assert got.store is not None and got.store.agreement.iteration == 40
    got.store.close()
    mine.close()


@pytest.mark.parametrize("run", [5, "../x", "A" * 10, "f" * 65])
def test_a_manifest_with_a_bad_run_is_refused(run):
    data = json.loads(sf.Manifest(1, 0, 1, {}, "ab").to_json())
    assert data["run"] == "ab" and sf.parse_manifest(json.dumps(data).encode(), "m").run == "ab"
    with pytest.raises(CheckpointError, match="not a snapshot manifest"):
        sf.parse_manifest(json.dumps({**data, "run": run}).encode(), "m")


def test_snapshots_wait_for_their_copies_on_peers(tmp_path, monkeypatch):
    """Where the pod's agent copies them, the next snapshot waits until the last one is on every holder (the
    agent's mark), or COPY_PATIENCE has passed: copies never fall more than one snapshot behind."""
    monotonic = [0.0]
    monkeypatch.setattr(snapshot.time, "monotonic", lambda: monotonic[0])
    snaps = snapshot.MemorySnapshots(tmp_path, 0, 1, interval=2, count_background=False, paced=True)
    snaps.resumed(0)
    assert snaps.due(2)
    snaps.written, snaps._written_at = 2, 0.0  # (what a write of iteration 2 leaves)
    assert not snaps.due(4)  # not copied yet
    sf.mark_copied(snaps.dir, 2)
    assert sf.copied(snaps.dir) == 2 and snaps.due(6)
    snaps.written = 6
    monotonic[0] = snapshot.COPY_PATIENCE + 1  # a holder that never answers: not waited for forever
    assert snaps.due(8)
    snaps.close()
