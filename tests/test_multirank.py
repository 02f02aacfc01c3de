"""Multi-rank training through the real CLI under `torchrun --nproc-per-node 2` (CPU, gloo).

Tolerances (lm loss is about 5-6 here, fp32 throughout):
- DP=2 vs DP=1 with the same global batch: |diff| <= 1e-5 per iteration (same samples, same
  micro-batch losses; only the order of the gradient sums differs).
- Resharded resume (DP2->DP1, DP2->TP2, TP2->DP1, PP2->PP1): |diff| <= 2e-3 per iteration against the
  uninterrupted run at the saving layout (TP splits matmul reductions and Adam amplifies the
  rounding differences of near-zero gradients a little; measured differences are far smaller).
  DP2->TP2 has no `model.vocab_size` override: the padded vocabulary grows from 384 to 512 rows; the
  checkpoint's padding rows are sliced/zero-padded and padding logits are masked out of the loss.
- Same-layout resume after SIGTERM, or after SIGKILL of one rank during a save: bit-exact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import threading
import time

import pytest
from kubetron.contract import exitcodes
from kubetron.contract.progress import parse_progress, summarize_events

from tests.multirank.runner import (
    GBS,
    ITERS,
    LOSS_TOL,
    TP2,
    args,
    close,
    collect,
    fault_at,
    launch,
    ok,
    start_plain_ranks,
    tb_scalars,
)

pytestmark = pytest.mark.process

# For the DP/TP runs: SwiGLU (gated fc1 re-interleaving), grouped-query attention, untied output layer
# (vocab-parallel along dim 0, padded to 384 rows at TP=1 and 512 at TP=2).
FLAVOR = ["model.activation=swiglu", "model.num_query_groups=2",
          "model.share_embeddings_and_output_weights=false"]
PP2 = ["model.pipeline_model_parallel_size=2"]


def falls(loss: dict[int, float], start: int, end: int):
    assert max(loss) >= end, loss
    assert loss[end] < loss[start] - 0.3, f"loss did not fall: {loss[start]} -> {loss[end]}"


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """The same 40 iterations at DP=1 (one process) and DP=2 (torchrun), checkpoints every 10."""
    base = tmp_path_factory.mktemp("dp")
    dp1 = launch(args(base / "dp1", *FLAVOR, "checkpoint.save_interval=10"), base / "ranks-dp1", nproc=1)
    ok(dp1, nproc=1)
    # straggler logging on (no stop): a report every 10 iterations, nothing else changes
    dp2 = launch(args(base / "dp2", *FLAVOR, "checkpoint.save_interval=10", "straggler.log_straggler=true",
                      "straggler.report_interval=10"), base / "ranks-dp2")
    ok(dp2)
    return {"base": base, "dp1": tb_scalars(base / "dp1" / "tb"), "dp2": tb_scalars(base / "dp2" / "tb"),
            "dp2_result": dp2}


def test_dp2_trains_and_matches_dp1(dp_runs):
    dp1, dp2 = dp_runs["dp1"], dp_runs["dp2"]
    assert sorted(dp2) == list(range(1, ITERS + 1))
    falls(dp2, 1, ITERS)
    close(dp2, dp1, range(1, ITERS + 1), 1e-5)
    r = dp_runs["dp2_result"]
    assert r.consumed_at(ITERS) == ITERS * GBS
    assert r.terms[0]["reason"] == r.terms[1]["reason"] == "Completed"
    assert r.stdout.count("straggler report at iteration") == ITERS // 10, r.tail()
    # the default (sharded) format: each rank wrote half of the tensor bytes, nothing gathered on rank 0
    shards = dp_runs["base"] / "dp2" / "iter_0000010" / "shards"
    sizes = [(shards / f"rank_{r:05d}.bin").stat().st_size for r in range(2)]
    assert abs(sizes[0] - sizes[1]) <= 0.1 * sum(sizes), sizes
    assert not (shards.parent / "model.pt").exists()
    # async saves are the default for multi-rank runs (sync for one rank), all four durable
    progress = {n: (dp_runs["base"] / n / "progress.txt").read_text() for n in ("dp1", "dp2")}
    assert progress["dp2"].count("Saved async checkpoint") == 4, progress["dp2"]
    assert progress["dp1"].count("Saved checkpoint") == 4 and "async" not in progress["dp1"], progress["dp1"]


def test_resume_dp2_at_dp1(dp_runs, tmp_path):
    base = dp_runs["base"]
    r = launch(args(tmp_path / "s", *FLAVOR, "checkpoint.ckpt_step=10", load=base / "dp2"), tmp_path / "ranks",
               nproc=1)
    ok(r, nproc=1)
    assert "at iteration 10" in r.stdout and r.consumed_at(11) == 11 * GBS, r.tail()
    loss = tb_scalars(tmp_path / "s" / "tb")
    assert sorted(loss) == list(range(11, ITERS + 1))
    close(loss, dp_runs["dp2"], range(11, ITERS + 1), LOSS_TOL)


def test_resume_dp2_at_tp2_then_tp2_at_dp1(dp_runs, tmp_path):
    """DP2 -> TP2 (train 21..30 at TP=2, save there) -> DP1 (31..40): continuous with the DP2 run."""
    base, ref = dp_runs["base"], dp_runs["dp2"]
    tp = launch(args(tmp_path / "tp", *FLAVOR, *TP2, "checkpoint.ckpt_step=20", "train.exit_interval=30",
                     load=base / "dp2"), tmp_path / "ranks-tp")
    ok(tp, exitcodes.EXIT_CONDITION)
    assert "at iteration 20" in tp.stdout and tp.consumed_at(21) == 21 * GBS, tp.tail()
    loss = tb_scalars(tmp_path / "tp" / "tb")
    assert sorted(loss) == list(range(21, 31))
    close(loss, ref, range(21, 31), LOSS_TOL)
    assert loss[30] < loss[21]
    assert tp.terms[0]["lastCheckpoint"] == tp.terms[1]["lastCheckpoint"] == 30

    dp = launch(args(tmp_path / "dp", *FLAVOR, load=tmp_path / "tp"), tmp_path / "ranks-dp", nproc=1)
    ok(dp, nproc=1)
    assert "at iteration 30" in dp.stdout and dp.consumed_at(31) == 31 * GBS, dp.tail()
    close(tb_scalars(tmp_path / "dp" / "tb"), ref, range(31, ITERS + 1), LOSS_TOL)


def test_pp2_trains_evaluates_and_resumes_at_pp1_and_back(tmp_path):
    """PP=2 with tied embeddings (shared across the first and last stage), evaluation on; its iter 20
    resumed at PP=1 (21..30, saved there), and that resumed at PP=2 again (31..40)."""
    pp = launch(args(tmp_path / "pp", *PP2, "checkpoint.save_interval=20", "validation.eval_interval=20",
                     "validation.eval_iters=2"), tmp_path / "ranks-pp")
    ok(pp)
    ref = tb_scalars(tmp_path / "pp" / "tb")
    assert sorted(ref) == list(range(1, ITERS + 1))
    falls(ref, 1, ITERS)
    assert "validation loss at iteration 20" in pp.stdout, pp.tail()
    r = launch(args(tmp_path / "one", "checkpoint.ckpt_step=20", "train.exit_interval=30", load=tmp_path / "pp"),
               tmp_path / "ranks-one", nproc=1)
    ok(r, exitcodes.EXIT_CONDITION, nproc=1)
    assert "at iteration 20" in r.stdout and r.consumed_at(21) == 21 * GBS, r.tail()
    close(tb_scalars(tmp_path / "one" / "tb"), ref, range(21, 31), LOSS_TOL)
    back = launch(args(tmp_path / "back", *PP2, load=tmp_path / "one"), tmp_path / "ranks-back")
    ok(back)
    assert "at iteration 30" in back.stdout and back.consumed_at(31) == 31 * GBS, back.tail()
    close(tb_scalars(tmp_path / "back" / "tb"), ref, range(31, ITERS + 1), LOSS_TOL)


def _saves(store) -> list[str]:
    text = (store / "progress.txt").read_text() if (store / "progress.txt").exists() else ""
    return [line for line in text.splitlines() if "\tSaved checkpoint\t" in line]


@pytest.mark.slow
def test_sigterm_four_times_then_exact_resume(dp_runs, tmp_path):
    """SIGTERM to both ranks, to rank 0, to rank 1, to both, at random iterations, each attempt resuming the last
    (many more preemptions of every kind: bench/chaos.py's soak on the real control plane):
    every attempt saves exactly one checkpoint (where all ranks stopped) and exits 75 on every rank;
    the stitched loss curve equals the uninterrupted DP=2 run (same config but for saving) bit for bit."""
    ref = dp_runs["dp2"]
    store = tmp_path / "s"
    rng = random.Random(4)
    done = 0
    for attempt in range(4):
        target = done + rng.randint(1, 2)
        ranks = [[0, 1], [0], [1]][attempt % 3]
        before = len(_saves(store))
        r = launch(args(store, *FLAVOR), tmp_path / f"ranks-{attempt}",
                   **fault_at(target, "TERM", ranks[0] if len(ranks) == 1 else None))
        assert r.codes == {0: 75, 1: 75}, (attempt, ranks, r.tail())
        saved = r.terms[0]["lastCheckpoint"]
        assert saved == r.terms[1]["lastCheckpoint"] == r.terms[0]["iteration"] == r.terms[1]["iteration"]
        assert saved == target > done, (attempt, saved, target, done)  # the iteration the signal came after
        saves = _saves(store)
        assert len(saves) == before + 1 and f"Iteration: {saved}\t" in saves[-1], saves
        assert (store / f"iter_{saved:07d}" / "metadata.json").is_file()
        if done:
            assert f"at iteration {done}" in r.stdout, r.tail()
        done = saved
    assert done < ITERS
    final = launch(args(store, *FLAVOR), tmp_path / "ranks-final")
    ok(final)
    assert tb_scalars(store / "tb") == ref


# (point of the save, rank to SIGKILL there, iteration the next run must resume from), in order
KILLS = {"fs": [("after-shard@20", 1, 10), ("after-commit@30", 0, 30)],
         "s3": [("after-shard@20", 0, 10), ("after-payload@30", 1, 20)]}


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_sigkill_one_rank_during_sharded_saves(dp_runs, tmp_path, s3_server, backend):
    """One rank SIGKILLed at a point of a sharded save, twice, each run resuming the store the previous
    one left: the next run resumes from the newest complete checkpoint, and the stitched losses equal the
    uninterrupted DP=2 run bit for bit. fs: rank 1 after its shard data (no index, no commit), then rank 0
    right after the commit marker (tracker not moved yet). s3, with async saves: rank 0 after its
    multipart upload completed, then rank 1 after its whole payload (in the background writer)."""
    store = str(tmp_path / "s") if backend == "fs" else f"s3://{s3_server.bucket}/{tmp_path.name}/job"
    env = s3_server.env() if backend == "s3" else {}
    extra = [*FLAVOR, "checkpoint.save_interval=10"] + (["checkpoint.async_save=true"] if backend == "s3" else [])
    resume_at = None
    for n, (point, rank, expect) in enumerate(KILLS[backend]):
        r = launch(args(store, *extra, tb=tmp_path / "tb"), tmp_path / f"ranks-{n}", KUBETRON_CHAOS_KILL_AT=point,
                   KUBETRON_CHAOS_RANK=rank, **env)
        assert r.returncode != 0 and rank not in r.codes, (point, r.codes, r.tail())  # died, never exited
        if resume_at:
            assert f"at iteration {resume_at}" in r.stdout, r.tail()
        resume_at = expect
    final = launch(args(store, *extra, tb=tmp_path / "tb"), tmp_path / "ranks-final", **env)
    ok(final)
    assert f"at iteration {resume_at}" in final.stdout, final.tail()
    assert tb_scalars(tmp_path / "tb") == dp_runs["dp2"]


def _run_plain_and_stop_rank1(tmp_path, a, sig: str, at_iteration: int, wait: float):
    """Rank 1 of a plain launch sends itself SIG<sig> once `at_iteration` is done; how long rank 0 takes to end
    after that (rank 1's exit or stop, as waitpid reports it: an event, not a printed line)."""
    procs = start_plain_ranks(a, tmp_path / "ranks", env_of=lambda r: fault_at(at_iteration, sig, rank=1))
    try:
        stopped = threading.Thread(target=os.waitpid, args=(procs[1].pid, os.WUNTRACED), daemon=True)
        stopped.start()  # returns at the stop (SIGSTOP); at the SIGKILL it reaps rank 1 (not waited on again)
        stopped.join(300)
        assert not stopped.is_alive(), (tmp_path / "ranks" / "out-1").read_text()[-2000:]
        t0 = time.monotonic()
        procs[0].wait(timeout=wait)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    out0 = (tmp_path / "ranks" / "out-0").read_text()
    _, terms = collect(tmp_path / "ranks", 2)
    return procs[0].returncode, elapsed, out0, terms


def test_sigkill_one_rank_other_exits_5_then_resume(tmp_path):
    """No torchrun (the operator's MASTER_ADDR/RANK launch): SIGKILL rank 1, rank 0 gets 'connection
    reset' from gloo at once and exits 5 with a termination message; the resume works."""
    store = tmp_path / "s"
    a = args(store, "checkpoint.save_interval=5", "dist.distributed_timeout_minutes=0.5")
    code, elapsed, out0, terms = _run_plain_and_stop_rank1(tmp_path, a, "KILL", 12, 60)
    assert code == exitcodes.PEER_FAILURE, out0[-3000:]
    assert elapsed < 30, elapsed  # the timeout (30 s) bounds it; a dead process is noticed at once
    assert terms[0]["reason"] == "PeerFailure" and "peer" in terms[0]["message"], terms
    # the progress log (rank 0's) says how the job ended as the exit code does
    summary = summarize_events(parse_progress((store / "progress.txt").read_text()))
    assert summary["lastExit"]["reason"] == "PeerFailure", summary["lastExit"]
    saved = summary["lastCheckpoint"]["iteration"]
    assert saved in (5, 10), saved  # rank 1 died at 12, the async save of 10 finalized or not yet
    r = launch(args(store), tmp_path / "ranks-resume", nproc=1)
    ok(r, nproc=1)
    assert f"at iteration {saved}" in r.stdout, r.tail()


def test_hung_rank_times_out(tmp_path):
    """SIGSTOP rank 1 (a hung peer keeps its sockets open): rank 0 exits 5 once
    dist.distributed_timeout_minutes (0.25 min here) has passed in a collective."""
    a = args(tmp_path / "s", "dist.distributed_timeout_minutes=0.25")
    code, elapsed, out0, terms = _run_plain_and_stop_rank1(tmp_path, a, "STOP", 2, 90)
    assert code == exitcodes.PEER_FAILURE, out0[-3000:]
    assert 10 <= elapsed < 60, elapsed
    assert "timed out" in terms[0]["message"].lower(), terms


def test_straggler_detected_and_stops(tmp_path):
    store = tmp_path / "s"
    r = launch(args(store, "straggler.log_straggler=true", "straggler.report_interval=4",
                    "straggler.relative_threshold=0.7", "straggler.stop_if_detected=true"),
               tmp_path / "ranks", KUBETRON_TEST_SLOW_RANK=1, KUBETRON_TEST_SLOW_SECONDS=0.15)
    ok(r, exitcodes.STRAGGLER)
    assert "straggler report at iteration 4: slowest ranks rank 1" in r.stdout, r.tail()
    assert r.terms[0]["lastCheckpoint"] == r.terms[1]["lastCheckpoint"] == 4
    assert "rank 1 at" in r.terms[0]["message"], r.terms
    assert (store / "iter_0000004" / "metadata.json").is_file()


DISTOPT = ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true",
           "ddp.bucket_size=20000"]  # several buckets, so overlap has something to overlap


def test_data_parallel_random_init_is_one_model_and_resumes_exactly(dp_runs, tmp_path):
    """rng.data_parallel_random_init: each DP rank initialises with its own seed, then DP rank 0's weights
    are broadcast (as megatron's DDP), so the run is the plain DP=2 run (dropout is 0 here) bit for bit,
    and its iteration-20 checkpoint resumes bit for bit."""
    store = tmp_path / "s"
    full = launch(args(store, *FLAVOR, "rng.data_parallel_random_init=true", "checkpoint.save_interval=20"),
                  tmp_path / "ranks-full")
    ok(full)
    loss = tb_scalars(store / "tb")
    assert loss == dp_runs["dp2"]
    again = launch(args(tmp_path / "again", *FLAVOR, "rng.data_parallel_random_init=true", "checkpoint.ckpt_step=20",
                        load=store), tmp_path / "ranks-again")
    ok(again)
    assert "at iteration 20" in again.stdout, again.tail()
    resumed = tb_scalars(tmp_path / "again" / "tb")
    assert resumed == {i: loss[i] for i in range(21, ITERS + 1)}


@pytest.fixture(scope="module")
def distopt_run(dp_runs):
    """The dp_runs DP=2 run again with the distributed optimizer and both overlaps on."""
    base = dp_runs["base"]
    r = launch(args(base / "distopt", *FLAVOR, *DISTOPT, "checkpoint.save_interval=10", "logger.log_params_norm=true"),
               base / "ranks-distopt")
    ok(r)
    return {"store": base / "distopt", "loss": tb_scalars(base / "distopt" / "tb"), "result": r}


def test_distributed_optimizer_matches_dp1_and_shards_state(dp_runs, distopt_run):
    """ZeRO-1 over DP=2 with overlapped grad reduce-scatter and param all-gather trains the same
    model as DP=1 (and DP=2 without it), while each rank keeps half of the optimizer state."""
    loss, r = distopt_run["loss"], distopt_run["result"]
    assert sorted(loss) == list(range(1, ITERS + 1))
    close(loss, dp_runs["dp1"], range(1, ITERS + 1), 1e-5)
    close(loss, dp_runs["dp2"], range(1, ITERS + 1), 1e-5)
    m = re.search(r"distributed optimizer: (\d+) buckets over 2 data-parallel ranks; this rank keeps optimizer "
                  r"state and fp32 main weights for (\d+) of (\d+) parameter elements", r.stdout)
    assert m, r.tail()
    buckets, own, total = map(int, m.groups())
    assert buckets >= 3 and abs(own - total / 2) <= buckets, m.group(0)
    assert r.consumed_at(ITERS) == ITERS * GBS


def test_distributed_optimizer_saves_the_ranges_each_rank_owns(distopt_run):
    """With the distributed optimizer, each rank writes the optimizer state of exactly the fragments it
    owns (no gather of whole parameters): bucket boundaries cut parameters mid-row, so some pieces are
    partial rows; together the two ranks cover every element of every state tensor once, each about
    half the bytes."""
    name = distopt_run["store"] / "iter_0000010" / "shards"
    index = [json.loads((name / f"rank_{r:05d}.json").read_text())["pieces"] for r in (0, 1)]
    optim = [[e for e in pieces if e["name"].startswith("optim/") and e["box"]] for pieces in index]
    covered: dict[str, int] = {}
    for e in optim[0] + optim[1]:
        covered[e["name"]] = covered.get(e["name"], 0) + math.prod(hi - lo for lo, hi in e["box"])
    assert covered and all(n == math.prod(next(e["global_shape"] for e in optim[0] + optim[1] if e["name"] == k))
                           for k, n in covered.items()), covered
    # fp32 parameters: no main_param (the fp32 weight saved with the model is the main, bit for bit)
    assert {k.rsplit("/", 1)[1] for k in covered} == {"exp_avg", "exp_avg_sq"}, covered.keys()
    cut = [e for e in optim[0] + optim[1] if len(e["box"]) == 2 and e["box"][0][1] - e["box"][0][0] == 1
           and e["box"][1][1] - e["box"][1][0] < e["global_shape"][1]]
    assert cut, "no piece is a partial row: the pieces do not follow the optimizer's fragments"
    share = sum(e["nbytes"] for e in optim[0]) / sum(e["nbytes"] for e in optim[0] + optim[1])
    assert 0.45 <= share <= 0.55, share


def test_distributed_optimizer_checkpoints_reshard(dp_runs, distopt_run, tmp_path):
    """Its checkpoints are canonical: distopt DP=2 -> plain DP=1 (iterations 21..30, saved) ->
    distopt DP=2 again (31..40), continuous with the uninterrupted distopt run; and a plain DP=2
    checkpoint resumes under the distributed optimizer."""
    ref = distopt_run["loss"]
    one = launch(args(tmp_path / "one", *FLAVOR, "checkpoint.ckpt_step=20", "train.exit_interval=30",
                      load=distopt_run["store"]), tmp_path / "ranks-one", nproc=1)
    ok(one, exitcodes.EXIT_CONDITION, nproc=1)
    assert "at iteration 20" in one.stdout and one.consumed_at(21) == 21 * GBS, one.tail()
    close(tb_scalars(tmp_path / "one" / "tb"), ref, range(21, 31), LOSS_TOL)
    back = launch(args(tmp_path / "back", *FLAVOR, *DISTOPT, load=tmp_path / "one"), tmp_path / "ranks-back")
    ok(back)
    assert "at iteration 30" in back.stdout and back.consumed_at(31) == 31 * GBS, back.tail()
    close(tb_scalars(tmp_path / "back" / "tb"), ref, range(31, ITERS + 1), LOSS_TOL)

    plain = launch(args(tmp_path / "plain", *FLAVOR, *DISTOPT, "checkpoint.ckpt_step=30",
                        load=dp_runs["base"] / "dp2"), tmp_path / "ranks-plain")
    ok(plain)
    close(tb_scalars(tmp_path / "plain" / "tb"), dp_runs["dp2"], range(31, ITERS + 1), 1e-5)


def test_distributed_optimizer_sigterm_resume_is_exact(distopt_run, tmp_path):
    """SIGTERM to both ranks mid-run: one checkpoint, exit 75, and the resume under the same layout
    continues the uninterrupted distopt run bit for bit (sharded Adam state and fp32 mains restored)."""
    store = tmp_path / "s"
    r = launch(args(store, *FLAVOR, *DISTOPT), tmp_path / "ranks-1", **fault_at(13, "TERM"))
    assert r.codes == {0: 75, 1: 75}, r.tail()
    saved = r.terms[0]["lastCheckpoint"]
    final = launch(args(store, *FLAVOR, *DISTOPT), tmp_path / "ranks-2")
    ok(final)
    assert f"at iteration {saved}" in final.stdout, final.tail()
    assert tb_scalars(store / "tb") == distopt_run["loss"]


def test_distributed_optimizer_bf16_and_pp2_with_tied_embeddings(tmp_path):
    """bf16 parameters (fp32 grad buffers, fp32 main fragments) at DP=2, and PP=2 with tied embeddings
    (the shared embedding's grad in its own all-reduced bucket, summed over the embedding group): each
    with the distributed optimizer tracks the same run without it; the bf16 one resumes bit for bit."""
    for name, extra in (("bf16", ["mixed_precision.bf16=true"]), ("pp2", PP2)):
        a = launch(args(tmp_path / f"{name}-plain", *extra, "train.train_iters=20"), tmp_path / f"r-{name}-a")
        ok(a)
        b = launch(args(tmp_path / f"{name}-distopt", *extra, *DISTOPT, "train.train_iters=20",
                        "checkpoint.save_interval=10"), tmp_path / f"r-{name}-b")
        ok(b)
        ref, got = tb_scalars(tmp_path / f"{name}-plain" / "tb"), tb_scalars(tmp_path / f"{name}-distopt" / "tb")
        falls(got, 1, 20)
        close(got, ref, range(1, 21), 1e-5 if name == "pp2" else 2e-3)
    # bf16: each rank saved the fp32 mains of the fragments it owns; a resume from iteration 10 at the same
    # layout restores them (not the bf16-rounded weights), so iterations 11..20 repeat bit for bit
    again = launch(args(tmp_path / "bf16-again", "mixed_precision.bf16=true", *DISTOPT, "train.train_iters=20",
                        "checkpoint.ckpt_step=10", load=tmp_path / "bf16-distopt"), tmp_path / "r-bf16-c")
    ok(again)
    want, got = tb_scalars(tmp_path / "bf16-distopt" / "tb"), tb_scalars(tmp_path / "bf16-again" / "tb")
    assert "at iteration 10" in again.stdout and {i: got[i] for i in range(11, 21)} == \
        {i: want[i] for i in range(11, 21)}, again.tail()


TORCH_DIST = ["checkpoint.ckpt_format=torch_dist"]


def test_torch_dist_checkpoints_with_distributed_optimizer_reshard(distopt_run, tmp_path):
    """megatron-core dist_checkpointing: DP=2 with the distributed optimizer, every rank writing its own
    shards, trains exactly as with canonical checkpoints; its iteration 20 resumes at TP=2 (21..30,
    saved as torch_dist at TP=2), and that at DP=1 with the default format (31..40)."""
    ref = distopt_run["loss"]
    dp = launch(args(tmp_path / "dp", *FLAVOR, *DISTOPT, *TORCH_DIST, "checkpoint.save_interval=10"),
                tmp_path / "ranks-dp")
    ok(dp)
    assert tb_scalars(tmp_path / "dp" / "tb") == ref
    files = sorted(p.name for p in (tmp_path / "dp" / "iter_0000020" / "dist").iterdir())
    assert ".metadata" in files and any(f.startswith("__1_") for f in files), files  # rank 1 wrote shards
    # torch_dist needs the same padded vocabulary at TP=2 (megatron checks global shapes): 384 as at TP=1
    tp = launch(args(tmp_path / "tp", *FLAVOR, *TP2, *TORCH_DIST, "model.vocab_size=384", "checkpoint.ckpt_step=20",
                     "train.exit_interval=30", load=tmp_path / "dp"), tmp_path / "ranks-tp")
    ok(tp, exitcodes.EXIT_CONDITION)
    assert "at iteration 20" in tp.stdout and tp.consumed_at(21) == 21 * GBS, tp.tail()
    close(tb_scalars(tmp_path / "tp" / "tb"), ref, range(21, 31), LOSS_TOL)
    assert (tmp_path / "tp" / "iter_0000030" / "dist" / ".metadata").is_file()
    one = launch(args(tmp_path / "one", *FLAVOR, load=tmp_path / "tp"), tmp_path / "ranks-one", nproc=1)
    ok(one, nproc=1)
    assert "at iteration 30" in one.stdout and one.consumed_at(31) == 31 * GBS, one.tail()
    close(tb_scalars(tmp_path / "one" / "tb"), ref, range(31, ITERS + 1), LOSS_TOL)


def test_torch_dist_pp2_with_tied_embeddings_resumes_at_pp1(tmp_path):
    pp = launch(args(tmp_path / "pp", *PP2, *TORCH_DIST, "train.train_iters=20", "checkpoint.save_interval=10"),
                tmp_path / "ranks-pp")
    ok(pp)
    ref = tb_scalars(tmp_path / "pp" / "tb")
    one = launch(args(tmp_path / "one", *TORCH_DIST, "train.train_iters=20", "checkpoint.ckpt_step=10",
                      load=tmp_path / "pp"), tmp_path / "ranks-one", nproc=1)
    ok(one, nproc=1)
    assert "at iteration 10" in one.stdout and one.consumed_at(11) == 11 * GBS, one.tail()
    close(tb_scalars(tmp_path / "one" / "tb"), ref, range(11, 21), LOSS_TOL)


def test_overlap_param_gather_needs_the_distributed_optimizer(tmp_path):
    r = launch(args(tmp_path / "s", "ddp.overlap_param_gather=true"), tmp_path / "ranks", nproc=1)
    assert r.returncode == exitcodes.CONFIG_ERROR, r.tail()
    assert "kubetron: error: ddp.overlap_param_gather: requires use_distributed_optimizer" in r.stderr, r.tail()


def test_sequence_parallel_without_transformer_engine_is_a_config_error(tmp_path):
    """The local layer spec's torch norms cannot shard the sequence: every rank exits 2 with one line
    naming the key, not megatron's AssertionError."""
    r = launch(args(tmp_path / "s", *TP2, "model.sequence_parallel=true", "model.transformer_impl=local"),
               tmp_path / "ranks")
    ok(r, exitcodes.CONFIG_ERROR)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kubetron: error: model.sequence_parallel: needs "
                                                                  "TransformerEngine")]
    assert len(lines) == 2 and "AssertionError" not in r.stderr, r.tail()
