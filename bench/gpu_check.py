"""`make gpu-check`: the GPU path's checks in one run, each row printed as it ends, then ONE summary table.

    make gpu-wheels                       # here, with network: .whl/ for the GPU machine's Python 3.12
    make gpu-check [ROWS=sigterm,ddp]     # there: installs .whl/ into a side directory, runs the rows
    python bench/gpu_check.py [--wheels .whl] [--rows ...]     # the same without make
    TINY=1 make gpu-check                 # CPU dry run (what CI runs): tiny shapes, few steps

ROWS (or --rows) picks the rows and their order, comma-separated keys (`all`: every row). Without it a GPU
runs DEFAULT_GPU_ROWS, most valuable first, which fit a 7-minute call on one H100 with the install; the
1.3B checkpoint row (`ckpt`, after a free-disk check) is a second call, `make gpu-check ROWS=ckpt`. The dry
run runs all rows. Each row is printed when it ends, and appended to $OUT/gpu-check.txt when OUT is set
(the device tool's output folder), so a call cut off at its time limit still returns the rows that ran.

Rows, in the default order (key  name: what it checks):
  sigterm  SIGTERM + exact resume: `kubetron train` with the distributed optimizer stopped by SIGTERM
           mid-run (exit 75), resumed: its losses equal an uninterrupted run's, bit for bit (TensorBoard's
           fp32 values); on CUDA the first run of megatron-core's distributed optimizer state save/load
  ddp      ddp.py (NCCL): bench/ddp.py: kubetron's and megatron-core's DDP / distributed optimizer train
           the same model to the same loss (one rank per GPU)
  moe1     MoE EP=1 train: `kubetron train` of a mixture-of-experts GPT (megatron-core's router,
           all-to-all dispatcher and experts) on one GPU: a loss per iteration, finite and falling, and
           its throughput (tokens/s, judged sane: finite, positive)
  parity   bf16 vs fp32 loss: a small GPT trained 50 steps in bf16 (fp32 main weights) and in fp32 from
           the same seed and data; target max abs loss difference <= PARITY_TOL
  mfu      gpu_step MFU ratio: bench/gpu_step.py: kubetron end to end vs plain PyTorch + torch.compile
           on examples/gpt-1p3b.yaml's shape; target ratio >= 1.13
  pp2      PP=2 megatron schedule: `kubetron train` at pipeline_model_parallel_size=2 under torchrun,
           through megatron-core's 1F1B schedule; needs 2 GPUs (SKIP otherwise). TINY=1: the same run
           on two CPU ranks (gloo; kubetron's GPipe schedule, as on CPU)
  moe2     MoE EP=2 all-to-all: the same at expert_model_parallel_size=2 under torchrun: each rank holds
           half the experts, tokens cross ranks by all-to-all; needs 2 GPUs (SKIP otherwise). TINY=1:
           on two CPU ranks (gloo)
  ckpt     checkpoint 1.3B async: bench/checkpoint.py --device cuda at the 1.3B shape (21 GB of model +
           optimizer state): the async save blocks the caller <= 1.0 s. It needs twice that on disk
           (SKIP, saying how much is free, otherwise)

Result column: PASS / FAIL; SKIP (cannot run on this machine: the reason is shown); DRY (TINY=1 on
CPU, the speed rows: a speed target only means something on a GPU, so the dry run judges what the
CPU can: every figure parsed, finite and positive, the ratio within DRY_RATIO, the async save
blocking no longer than it takes to be durable and at most DRY_BLOCK_MAX_S; the target column
shows those bounds; a figure outside them is a FAIL). Exit code 1 if any row FAILs. Each check runs
in its own process(es) so a crash is one FAIL row.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = str(ROOT / "examples" / "tiny-gpt.yaml")
PARITY_TOL = 0.02  # lm loss; CPU measured 3e-4 over 30 steps (tests/test_mixed_precision.py)
MFU_TARGET, ASYNC_BLOCK_TARGET_S = 1.13, 1.0
# The dry run's sanity bounds (CPU, tiny shapes, 3 steps). On the 2-core machine shared by other jobs the
# ratio measured 0.12-1.05 at load 15, and 0.014 at load 5-7 (one tiny step is a few ms: one descheduling
# of the process is a whole step), and the async save blocked 0.25-0.85 s of 0.3-0.9 s to durable. So the
# ratio's bounds only catch the absurd (a stall of a second per step: below 1/500); what does not depend on
# the load is checked exactly (judge_gpu_step: each variant's tokens/s x step time = its tokens per step,
# which catches a unit slip, and the ratio = the two step times' ratio).
DRY_RATIO = (0.002, 500.0)  # kubetron end to end / plain PyTorch eager, throughput
DRY_BLOCK_MAX_S = 5.0  # async save of 16 MB on CPU: what the caller waits for
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64"]
# The MoE rows: 4 experts, top 2, a load-balancing loss; on a GPU a wider model in bf16 at 1024 tokens
MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01",
       "model.normalization=RMSNorm", "model.activation=swiglu", "model.add_bias_linear=false"]
MOE_GPU = ["model.num_layers=4", "model.hidden_size=1024", "model.num_attention_heads=16", "model.seq_length=1024",
           "model.ffn_hidden_size=2816", "mixed_precision.bf16=true"]


@dataclass
class Row:
    name: str
    result: str  # PASS | FAIL | SKIP | DRY
    figure: str
    target: str


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "trainer"), env.get("PYTHONPATH")]))
    return env


# torchrun as the running interpreter's module: a GPU image's Python may have no `torchrun` script beside it
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**_env(), **env}, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _tail(p: subprocess.CompletedProcess) -> str:
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1][:100] if lines else f"exit {p.returncode}"


def _finite_positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def _judge(sane: bool, meets_target: bool, tiny: bool) -> str:
    """A speed row: sane figures are a DRY pass on CPU; on a GPU they must also meet the target."""
    if not sane:
        return "FAIL"
    return "DRY" if tiny else ("PASS" if meets_target else "FAIL")


# --- the checks -------------------------------------------------------------------------------------

def check_gpu_step(tiny: bool) -> Row:
    args = ["--tiny", "--steps", "3", "--warmup", "1", "scheduler.lr_warmup_iters=1"] if tiny else []
    p = _run([sys.executable, str(ROOT / "bench" / "gpu_step.py"), *args], timeout=600)
    m = re.search(r"ratio kubetron / baseline \(throughput\): (\S+)", p.stdout)
    # per variant: step ms, tokens/s, TFLOP/s, MFU %, peak GiB (nan without CUDA)
    variants = {label.strip(): [float(v) for v in values.split()] for label, values in re.findall(
        r"^(kubetron train\(\) end to end|plain PyTorch[^\d]*?)\s+(\S+\s+\S+\s+\S+\s+\S+\s+\S+)$", p.stdout, re.M)}
    shape = re.search(r"seq=(\d+) gbs=(\d+)", p.stdout)
    if p.returncode or not m or not shape:
        return Row("gpu_step MFU ratio", "FAIL", _tail(p), f">= {MFU_TARGET}")
    return judge_gpu_step(float(m.group(1)), variants, int(shape.group(1)) * int(shape.group(2)), tiny)


# gpu_step.py prints step ms to 0.1 and tokens/s to 1: on a fast CPU (a few ms a step) that rounding alone
# moves a ratio of two step times by more than 1 %, so the checks allow for it.
MS_ROUNDING, TPS_ROUNDING = 0.05, 0.5


def _consistent(ms: float, tokens_per_s: float, tokens_per_step: int) -> bool:
    """tokens/s x step time = the tokens of one step, within 2 % and the printed figures' rounding."""
    rounding = (tokens_per_s * MS_ROUNDING + TPS_ROUNDING * ms) / 1e3
    return math.isclose(tokens_per_s * ms / 1e3, tokens_per_step, rel_tol=0.02, abs_tol=rounding)


def _is_ratio_of(ratio: float, base_ms: float, ours_ms: float) -> bool:
    """The printed ratio is the two printed step times' ratio, within 1 % and their rounding (0.05 ms each)."""
    rel = 0.01 + MS_ROUNDING / base_ms + MS_ROUNDING / ours_ms
    return math.isclose(ratio, base_ms / ours_ms, rel_tol=rel, abs_tol=2e-3)


def judge_gpu_step(ratio: float, variants: dict[str, list[float]], tokens_per_step: int, tiny: bool) -> Row:
    """Both variants measured: step ms and tokens/s finite, positive and consistent with the step's tokens,
    MFU a percentage, the printed ratio their throughput ratio; on CPU within DRY_RATIO, on a GPU also
    >= MFU_TARGET. `variants`: label -> [step ms, tokens/s, TFLOP/s, MFU %, peak GiB]."""
    ours = variants.get("kubetron train() end to end")
    base = next((v for k, v in variants.items() if k.startswith("plain PyTorch")), None)
    sane = ours is not None and base is not None and _finite_positive(ratio, ours[0], ours[1], base[0], base[1])
    if sane:
        sane = (0.0 <= ours[3] <= 100.0 and all(_consistent(v[0], v[1], tokens_per_step) for v in (ours, base))
                and _is_ratio_of(ratio, base[0], ours[0])
                and (not tiny or DRY_RATIO[0] <= ratio <= DRY_RATIO[1]))
    target = f"{DRY_RATIO[0]:g}..{DRY_RATIO[1]:g} on CPU (GPU: >= {MFU_TARGET})" if tiny else f">= {MFU_TARGET}"
    figure = f"{ratio:.3f}" + (f" (kubetron MFU {ours[3]:.1f} %)" if ours else " (no kubetron row)")
    return Row("gpu_step MFU ratio", _judge(sane, ratio >= MFU_TARGET, tiny), figure, target)


def check_parity(tiny: bool) -> Row:
    p = _run([sys.executable, __file__, "--worker", "parity", "10" if tiny else "50"], timeout=600)
    if p.returncode:
        return Row("bf16 vs fp32 loss", "FAIL", _tail(p), f"max abs diff <= {PARITY_TOL}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    diff = max(abs(a - b) for a, b in zip(r["fp32"], r["bf16"], strict=True))
    ok = diff <= PARITY_TOL and r["fp32"][-1] < r["fp32"][0]
    return Row("bf16 vs fp32 loss", "PASS" if ok else "FAIL",
               f"max abs diff {diff:.2e} over {len(r['fp32'])} steps ({r['fp32'][0]:.3f} -> {r['fp32'][-1]:.3f})",
               f"<= {PARITY_TOL}")


def _train_cmd(out: Path, iters: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kubetron", "train", "--config", TINY_CONFIG, *SMALL,
            f"train.train_iters={iters}", "train.global_batch_size=4", "train.micro_batch_size=2",
            "logger.log_interval=1", "validation.eval_interval=null", f"checkpoint.save={out / 'ckpt'}",
            f"checkpoint.load={out / 'ckpt'}", "checkpoint.save_interval=1000", f"logger.tensorboard_dir={out / 'tb'}",
            f"train.termination_log={out / 'term'}", *extra]


def _tb_losses(logdir: Path, tag: str = "lm loss") -> dict[int, float]:
    """{iteration: value} of one TensorBoard scalar (the LM loss unless `tag` says otherwise)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for f in sorted(logdir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            values.update({ev.step: ev.value for ev in acc.Scalars(tag)})
    return values


def _run_until_then_sigterm(cmd: list[str], k: int, timeout: float) -> int:
    """Run `cmd`, which sends itself SIGTERM once iteration k is done (kubetron.cli's KUBETRON_CHAOS_KILL_AT=step@k:
    the run's own step, not a line read from its output, which a loaded machine reads late); its exit code."""
    if str(ROOT / "trainer") not in sys.path:  # (a GPU machine runs this script with the wheels, not the checkout)
        sys.path.insert(0, str(ROOT / "trainer"))
    from kubetron.cli import CHAOS_KILL_AT_ENV, CHAOS_SIGNAL_ENV

    env = {**_env(), CHAOS_KILL_AT_ENV: f"step@{k}", CHAOS_SIGNAL_ENV: "TERM"}
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        return p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def check_sigterm_resume(tiny: bool) -> Row:
    # The run SIGTERMs itself once iteration k is done: it saves there and exits 75.
    iters, k = (60, 3) if tiny else (40, 20)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        a, b = Path(tmp, "a"), Path(tmp, "b")
        # with the distributed optimizer: its sharded save/load of the state it owns (on CUDA megatron-core's)
        opt = ["ddp.use_distributed_optimizer=true"]
        full = subprocess.Popen(_train_cmd(a, iters, *opt), env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # the uninterrupted run, alongside
        stopped = _run_until_then_sigterm(_train_cmd(b, iters, *opt), k, timeout=600)
        resumed = _run(_train_cmd(b, iters, *opt), timeout=600)
        full_rc = full.wait(timeout=600)
        if (full_rc, stopped, resumed.returncode) != (0, 75, 0):
            return Row("SIGTERM + exact resume", "FAIL", f"exit codes full/stopped/resumed = {full_rc}/{stopped}/"
                       f"{resumed.returncode} (want 0/75/0)", "bit-exact losses")
        want, got = _tb_losses(a / "tb"), _tb_losses(b / "tb")
    same = sorted(want) == sorted(got) == list(range(1, iters + 1)) and all(want[i] == got[i] for i in want)
    return Row("SIGTERM + exact resume", "PASS" if same else "FAIL",
               f"{iters} iterations, stopped after {k}: " + ("losses identical" if same else "losses differ"),
               "bit-exact losses")


def check_checkpoint(tiny: bool, cuda: bool) -> Row:
    size_mb = 16 if tiny else 21000
    args = ["--size-mb", str(size_mb), "--device", "cpu" if tiny else "cuda"]
    if (short := disk_shortfall(size_mb)) is not None:
        return Row("checkpoint 1.3B async", "SKIP", short, f"blocked <= {ASYNC_BLOCK_TARGET_S} s")
    p = _run([sys.executable, str(ROOT / "bench" / "checkpoint.py"), *args, "--s3", "off", "--repeats", "1"],
             timeout=600)
    m = re.search(r"async save: caller blocked[:|\s]+(\S+)s .*?async durable after (\S+)s", p.stdout)
    if p.returncode or not m:
        return Row("checkpoint 1.3B async", "FAIL", _tail(p), f"blocked <= {ASYNC_BLOCK_TARGET_S} s")
    return judge_checkpoint(float(m.group(1)), float(m.group(2)), tiny)


def disk_shortfall(size_mb: int, where: str | None = None) -> str | None:
    """Why the checkpoint bench cannot run here, or None: it keeps two saves of `size_mb` MB (the sync
    one and the async one) in the temp dir, plus a tenth for the index and the filesystem."""
    free = shutil.disk_usage(where or tempfile.gettempdir()).free / 1e6
    need = 2.2 * size_mb
    return None if free >= need else f"needs {need / 1e3:.0f} GB free in {where or tempfile.gettempdir()}, " \
                                     f"has {free / 1e3:.0f} GB"


def judge_checkpoint(blocked: float, durable: float, tiny: bool) -> Row:
    """The caller's wait and the time to durable, both measured, the wait no longer than the whole save;
    on CPU at most DRY_BLOCK_MAX_S, on a GPU at most ASYNC_BLOCK_TARGET_S."""
    sane = _finite_positive(blocked, durable) and blocked <= durable and (not tiny or blocked <= DRY_BLOCK_MAX_S)
    target = (f"<= {DRY_BLOCK_MAX_S:g} s and <= durable on CPU (GPU: <= {ASYNC_BLOCK_TARGET_S} s)" if tiny
              else f"blocked <= {ASYNC_BLOCK_TARGET_S} s")
    size = "16 MB on CPU" if tiny else "21 GB"
    return Row("checkpoint 1.3B async", _judge(sane, blocked <= ASYNC_BLOCK_TARGET_S, tiny),
               f"{blocked:.3f} s, durable after {durable:.3f} s ({size})", target)


def check_ddp(tiny: bool, gpus: int) -> Row:
    nproc = 2 if tiny else max(gpus, 1)
    shape = ["--layers", "1", "--hidden", "64", "--seq", "32", "--mbs", "2", "--gbs", "4", "--steps", "1",
             "--reps", "1", "--warmup", "1"] if tiny else []
    p = _run([sys.executable, str(ROOT / "bench" / "ddp.py"), "--nproc", str(nproc), *shape], timeout=600)
    losses = {m.group(1): float(m.group(2))
              for m in re.finditer(r"^(\S+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([-\d.]+)$", p.stdout, re.M)}
    backend = "gloo" if tiny else "NCCL"
    if p.returncode or len(losses) < 4:
        return Row("ddp.py (NCCL)", "FAIL", _tail(p), "same loss across variants")
    spread = max(losses.values()) - min(losses.values())
    return Row("ddp.py (NCCL)", "PASS" if spread <= 1e-3 else "FAIL",
               f"{len(losses)} variants, {nproc} ranks ({backend}), loss spread {spread:.1e}", "spread <= 1e-3")


def _train_run(name: str, tmp: Path, iters: int, nproc: int, where: str, *extra: str, throughput: bool = False,
               **env: str) -> Row:
    """`kubetron train` on `nproc` ranks (torchrun when more than one), judged by judge_run."""
    train = _train_cmd(tmp, iters, *extra)
    cmd = [*TORCHRUN, "--nproc-per-node", str(nproc), *train[1:]] if nproc > 1 else train
    p = _run(cmd, timeout=600, **env)
    row = judge_run(name, p.returncode, _tb_losses(tmp / "tb"), iters, where,
                    _tb_losses(tmp / "tb", "throughput/tokens_per_sec") if throughput else None)
    return row if row.result == "PASS" or p.returncode == 0 else Row(row.name, "FAIL", _tail(p), row.target)


def check_pp2(tiny: bool, gpus: int) -> Row:
    if not tiny and gpus < 2:
        return Row("PP=2 megatron schedule", "SKIP", f"needs 2 GPUs, found {gpus}", "exit 0, loss falls")
    iters = 8 if tiny else 30  # on CPU: two ranks over gloo, kubetron's GPipe schedule (megatron's needs CUDA)
    with tempfile.TemporaryDirectory(prefix="gpu-check-pp-") as tmp:
        return _train_run("PP=2 megatron schedule", Path(tmp), iters, 2,
                          "2 CPU ranks (gloo)" if tiny else "2 GPUs (NCCL)", "model.pipeline_model_parallel_size=2",
                          "train.global_batch_size=8", "checkpoint.ckpt_format=torch_dist",
                          "scheduler.lr_warmup_iters=1")


def check_moe(tiny: bool, gpus: int, ep: int) -> Row:
    """A mixture-of-experts GPT trained at expert_model_parallel_size=ep (and DP=ep), one rank per GPU."""
    name = f"MoE EP={ep} " + ("train" if ep == 1 else "all-to-all")
    if not tiny and gpus < ep:
        return Row(name, "SKIP", f"needs {ep} GPUs, found {gpus}", "exit 0, loss falls, tokens/s > 0")
    iters = 10 if tiny else 30
    where = f"{ep} CPU rank(s) (gloo)" if tiny else f"{ep} GPU(s)"
    shape = [] if tiny else MOE_GPU
    # on CPU one intra-op thread per rank, as torchrun gives each (a busy 2-core machine otherwise spends
    # the step in thread contention: 40x slower measured under load)
    env = {"OMP_NUM_THREADS": "1"} if tiny else {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-moe-") as tmp:
        return _train_run(name, Path(tmp), iters, ep, where, *MOE, *shape, f"model.expert_model_parallel_size={ep}",
                          f"train.global_batch_size={4 * ep}", "scheduler.lr_warmup_iters=1", "optimizer.lr=3e-3",
                          throughput=True, **env)


def judge_pp2(returncode: int, losses: dict[int, float], iters: int, where: str) -> Row:
    return judge_run("PP=2 megatron schedule", returncode, losses, iters, where)


def judge_run(name: str, returncode: int, losses: dict[int, float], iters: int, where: str,
              tokens_per_s: dict[int, float] | None = None) -> Row:
    """Exit 0, one finite loss per iteration, the last below the first; with `tokens_per_s` (the logged
    throughput per iteration; the first iteration's is 0, nothing timed before it) also a finite, positive
    throughput after it, shown as its median."""
    complete = sorted(losses) == list(range(1, iters + 1)) and all(math.isfinite(v) for v in losses.values())
    ok = returncode == 0 and complete and losses[iters] < losses[1]
    fig = (f"loss {losses[1]:.3f} -> {losses[iters]:.3f} over {iters} iterations, {where}" if complete
           else f"exit {returncode}, losses logged for {len(losses)} of {iters} iterations")
    target = "exit 0, loss falls"
    if tokens_per_s is not None:
        rates = sorted(v for it, v in tokens_per_s.items() if it > 1)
        ok = ok and bool(rates) and _finite_positive(*rates)
        fig += f", {rates[len(rates) // 2]:.0f} tokens/s" if rates else ", no throughput logged"
        target += ", tokens/s > 0"
    return Row(name, "PASS" if ok else "FAIL", fig, target)


# --- worker: bf16 vs fp32 in one process --------------------------------------------------------------

def parity_worker(steps: int) -> None:
    """Train the small GPT `steps` steps in fp32 and in bf16 (same seed, same data) through the real
    entry point; print {"fp32": [...], "bf16": [...]} per-step losses as JSON."""
    import logging

    sys.path.insert(0, str(ROOT / "trainer"))
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before anything imports megatron-core
    from kubetron.config import ConfigContainer
    from kubetron.training import entry
    from kubetron.training.gpt_step import forward_step
    from kubetron.training.state import GlobalState

    logging.basicConfig(level=logging.WARNING)
    out = {}
    for name, extra in (("fp32", []), ("bf16", ["mixed_precision.bf16=true"])):
        losses = []

        def recording_step(state: GlobalState, data_iterator, model, losses=losses):
            output, loss_func = forward_step(state, data_iterator, model)

            def record(output_tensor):
                loss, num_tokens, report = loss_func(output_tensor)
                losses.append(float(report["lm loss"][0] / report["lm loss"][1]))
                return loss, num_tokens, report
            return output, record

        cfg = ConfigContainer.from_yaml(TINY_CONFIG, [
            *SMALL, f"train.train_iters={steps}", "train.micro_batch_size=4", "train.global_batch_size=4",
            "checkpoint.save=null", "validation.eval_interval=null", "train.exit_signal_handler=false",
            "logger.log_interval=1000", "scheduler.lr_warmup_iters=2", *extra])
        code = entry._run(cfg, recording_step, "pretrain")
        assert code == 0, f"{name} run exited {code}"
        out[name] = losses
    print(json.dumps(out))


# --- main ----------------------------------------------------------------------------------------------

# key -> (row name, check(tiny, cuda, gpus)), in the default order: most valuable first (what no CPU test can
# reach), the 21 GB checkpoint row last
ROWS = {
    "sigterm": ("SIGTERM + exact resume", lambda tiny, cuda, gpus: check_sigterm_resume(tiny)),
    "ddp": ("ddp.py (NCCL)", lambda tiny, cuda, gpus: check_ddp(tiny, gpus)),
    "moe1": ("MoE EP=1 train", lambda tiny, cuda, gpus: check_moe(tiny, gpus, 1)),
    "parity": ("bf16 vs fp32 loss", lambda tiny, cuda, gpus: check_parity(tiny)),
    "mfu": ("gpu_step MFU ratio", lambda tiny, cuda, gpus: check_gpu_step(tiny)),
    "pp2": ("PP=2 megatron schedule", lambda tiny, cuda, gpus: check_pp2(tiny, gpus)),
    "moe2": ("MoE EP=2 all-to-all", lambda tiny, cuda, gpus: check_moe(tiny, gpus, 2)),
    "ckpt": ("checkpoint 1.3B async", lambda tiny, cuda, gpus: check_checkpoint(tiny, cuda)),
}
DEFAULT_GPU_ROWS = ("sigterm", "ddp", "moe1", "parity", "mfu", "pp2", "moe2")  # ~7 min on one H100; ckpt: 2nd call


def select_rows(text: str | None, tiny: bool) -> list[str]:
    """The row keys to run, in order: `text` ("a,b", "all") or the default (every row on the dry run)."""
    if not text:
        return list(ROWS) if tiny else list(DEFAULT_GPU_ROWS)
    keys = list(ROWS) if text.strip() == "all" else [k.strip() for k in text.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in ROWS]:
        raise SystemExit(f"gpu-check: ROWS: unknown row {', '.join(unknown)} (rows: {', '.join(ROWS)}, or all)")
    return keys


def use_wheels(wheels: Path) -> None:
    """Install the wheel folder (`make gpu-wheels`) into a side directory and put it first on the path of this
    process and of every check it starts."""
    import gpu_wheels  # beside this script (its directory is sys.path[0])

    target = Path(os.environ.get("KUBETRON_GPU_SITE") or Path(tempfile.gettempdir(), "kubetron-gpu-site"))
    t0 = time.monotonic()
    gpu_wheels.install(wheels, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(target))
    print(f"gpu-check: installed {wheels} into {target} ({time.monotonic() - t0:.0f} s)", flush=True)


class Report:
    """Each row as it ends: on stdout and, when $OUT is set, appended to $OUT/gpu-check.txt."""

    def __init__(self, out_dir: str | None):
        self.path = Path(out_dir, "gpu-check.txt") if out_dir else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def line(self, text: str) -> None:
        print(text, flush=True)
        if self.path:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(text + "\n")


def run_rows(keys: list[str], tiny: bool, cuda: bool, gpus: int, report: Report) -> list[Row]:
    rows, t0 = [], time.monotonic()
    for key in keys:
        name, check = ROWS[key]
        try:
            row = check(tiny, cuda, gpus)
        except Exception as e:  # one broken check is one FAIL row, the table still prints
            row = Row(name, "FAIL", f"{type(e).__name__}: {e}"[:100], "")
        rows.append(row)
        report.line(f"  {key}: {row.name}: {row.result}: {row.figure} (target {row.target or '-'}) "
                    f"[{time.monotonic() - t0:.0f} s]")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 and argv[0] == "--worker":
        parity_worker(int(argv[2]))
        os._exit(0)  # skip interpreter teardown of megatron's process groups
    import argparse

    ap = argparse.ArgumentParser(description="The GPU path's checks (bench/gpu_check.py's docstring says which).")
    ap.add_argument("--rows", default=os.environ.get("ROWS"), help="comma-separated row keys, or all (env ROWS)")
    ap.add_argument("--wheels", type=Path, default=None, help="a `make gpu-wheels` folder to install first")
    args = ap.parse_args(argv)
    tiny = os.environ.get("TINY", "") not in ("", "0")
    keys = select_rows(args.rows, tiny)
    if args.wheels:
        use_wheels(args.wheels)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not tiny:
        print("gpu-check: no CUDA device here; run it on a GPU machine, or TINY=1 for the CPU dry run")
        return 2
    gpus = torch.cuda.device_count() if cuda else 0
    where = "CPU dry run (TINY=1)" if tiny else f"{gpus} x {torch.cuda.get_device_name()}"
    report = Report(os.environ.get("OUT"))
    report.line(f"gpu-check on {where}: torch {torch.__version__}, rows {','.join(keys)}")
    rows = run_rows(keys, tiny, cuda, gpus, report)
    report.line(table(rows, where))
    return 1 if any(r.result == "FAIL" for r in rows) else 0


def table(rows: list[Row], where: str) -> str:
    head = Row("check", "result", "measured", "target")
    w = [max(len(getattr(r, f)) for r in [head, *rows]) for f in ("name", "result", "figure", "target")]
    line = "+-" + "-+-".join("-" * x for x in w) + "-+"
    out = [f"\ngpu-check summary ({where})", line]
    for r in [head, *rows]:
        out.append("| " + " | ".join(v.ljust(x) for v, x in zip((r.name, r.result, r.figure, r.target), w,
                                                                 strict=True)) + " |")
        if r is head:
            out.append(line)
    return "\n".join([*out, line])


if __name__ == "__main__":
    sys.exit(main())
