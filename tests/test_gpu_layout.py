"""The GPU machine's layout, simulated here, so the one prepared command works on the first call of a lease.

The lent GPU machine has Python, a CUDA torch 2.11 and a few packages (numpy, psutil, tensorboard, pyyaml),
no package index, and not this project: `make gpu-wheels` here brings what it lacks, `make gpu-check` there
installs that folder without dependencies onto PYTHONPATH and runs the checks from the source tree. Here
the same layout is built with this machine's Python: an interpreter whose torch is the 2.11.0 wheel (the
CUDA build, as there), the image's packages, the wheels that
`make gpu-wheels` downloads for this Python, and the project NOT installed. Then:

- `make gpu-check TINY=1` through that layout passes every row, each printed as it ends and written to
  $OUT/gpu-check.txt;
- under torch 2.11's torchrun (which ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT, new in 2.12), a checkpoint save
  that takes longer than 30 s after SIGTERM completes: kubetron.torchrun passes the launcher's grace on.

torch 2.11.0's wheel and the CUDA libraries it loads at import (2.4 GB, 4 GB installed) are downloaded once per
machine into ~/.cache/kubetron.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.multirank.runner import fault_at
from tests.trainer_utils import TINY, LineReader, bench_module, free_port, sigterm_while_stopped, stopped_trainer

ROOT = Path(__file__).resolve().parent.parent
OLD_TORCH = "2.11.0"  # the GPU machine's torch, older than the project's own (2.13.0)
CACHE = Path(os.environ.get("KUBETRON_CACHE") or Path.home() / ".cache" / "kubetron")
# What the GPU machine's image has besides torch (README, "Notes for the next developer"), and torch's own
# pure-Python dependencies, which its wheel brings there
IMAGE_PACKAGES = ("numpy", "psutil", "tensorboard", "pyyaml", "typing_extensions", "sympy", "filelock", "jinja2",
                  "fsspec", "networkx")
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _pip(python: str | Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   capture_output=True, text=True)


# torch 2.11.0's wheel is a CUDA build: it loads these libraries at import, also on a machine without a GPU
# (its requirements at their pinned versions, less triton, which only torch.compile imports)
OLD_TORCH_WHEELS = (
    f"torch=={OLD_TORCH}", "nvidia-cudnn-cu13==9.19.0.56", "nvidia-cusparselt-cu13==0.8.0", "nvidia-nccl-cu13==2.28.9",
    "nvidia-nvshmem-cu13==3.4.5", "nvidia-cublas==13.1.0.3", "nvidia-cuda-cupti==13.0.85", "nvidia-cuda-nvrtc==13.0.88",
    "nvidia-cuda-runtime==13.0.96", "nvidia-cufft==12.0.0.61", "nvidia-cufile==1.15.1.6", "nvidia-curand==10.4.0.35",
    "nvidia-cusolver==12.0.4.66", "nvidia-cusparse==12.6.3.3", "nvidia-nvjitlink==13.0.88", "nvidia-nvtx==13.0.85",
    "cuda-toolkit==13.0.2", "cuda-bindings==13.5.0", "cuda-pathfinder==1.9.1")


def old_torch_site() -> Path:
    """A directory holding torch 2.11.0 and the CUDA libraries it loads (2.4 GB of wheels), made once."""
    site = CACHE / f"torch-{OLD_TORCH}-cp{PY_VERSION.replace('.', '')}-site"
    if not (site / "torch" / "version.py").is_file():
        tmp = Path(str(site) + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _pip(sys.executable, "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp / "whl"), *OLD_TORCH_WHEELS)
        wheels = map(str, (tmp / "whl").glob("*.whl"))
        _pip(sys.executable, "install", "--no-deps", "--target", str(tmp / "site"), *wheels)
        shutil.rmtree(site, ignore_errors=True)
        (tmp / "site").rename(site)
        shutil.rmtree(tmp, ignore_errors=True)
    return site


@pytest.fixture(scope="module")
def gpu_machine(tmp_path_factory):
    """(python, wheel dir, site dir with the wheels installed): the GPU machine's layout with this Python."""
    root = tmp_path_factory.mktemp("gpu-machine")
    torch_site = old_torch_site()
    image = root / "image"
    subprocess.run([sys.executable, "-m", "venv", str(image)], check=True)
    python = image / "bin" / "python"
    _pip(python, "install", "-c", str(ROOT / "constraints.txt"), *IMAGE_PACKAGES)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "torch-2-11.pth").write_text(str(torch_site) + "\n")  # torch "installed" in the image
    wheels = root / "whl"
    subprocess.run(["make", "-s", "gpu-wheels", f"GPU_PYTHON_VERSION={PY_VERSION}", f"WHEEL_DIR={wheels}"],
                   cwd=ROOT, check=True, env=_clean_env())
    site = root / "site"
    _pip(python, "install", "--no-index", "--no-deps", "--target", str(site), *map(str, wheels.glob("*.whl")))
    return python, wheels, site


def _clean_env(**extra: str) -> dict:
    """This process's environment without what points at the project's .venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def test_the_layout_is_the_gpu_machines(gpu_machine):
    """torch is 2.11.0 there, and neither the project nor megatron-core is importable without the wheels."""
    python, _, _ = gpu_machine
    probe = ("import importlib.util as u, torch; print(torch.__version__.split('+')[0], "
             "[m for m in ('kubetron', 'megatron', 'pydantic', 'boto3') if u.find_spec(m)])")
    out = subprocess.run([str(python), "-c", probe], cwd="/", env=_clean_env(), capture_output=True, text=True)
    assert out.stdout.split(None, 1) == [OLD_TORCH, "[]\n"], out.stderr[-2000:]


def test_gpu_check_tiny_through_the_gpu_layout(gpu_machine, tmp_path):
    """`make gpu-check TINY=1` with the machine's python and the `make gpu-wheels` folder: every row runs in
    the default order and passes (DRY for the speed rows), each printed as it ends and into $OUT."""
    python, wheels, _ = gpu_machine
    env = _clean_env(OUT=str(tmp_path / "out"), KUBETRON_GPU_SITE=str(tmp_path / "site"))
    out = subprocess.run(["make", "-s", "gpu-check", "TINY=1", f"GPU_PY={python}", f"GPU_WHEELS={wheels}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert f"torch {OLD_TORCH}" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout[out.stdout.index("gpu-check summary"):]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # after the header row
    results = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in rows}
    assert list(results.items()) == [
        ("SIGTERM + exact resume", "PASS"), ("ddp.py (NCCL)", "PASS"), ("MoE EP=1 train", "PASS"),
        ("bf16 vs fp32 loss", "PASS"), ("gpu_step MFU ratio", "DRY"), ("PP=2 megatron schedule", "PASS"),
        ("MoE EP=2 all-to-all", "PASS"), ("checkpoint 1.3B async", "DRY")], table
    assert "2 CPU ranks (gloo)" in table and "2 CPU rank(s) (gloo)" in table and "tokens/s" in table
    assert out.returncode == 0, out.stderr[-3000:]
    # each row as it ended, before the table: what a call cut off at its limit still returns
    written = (tmp_path / "out" / "gpu-check.txt").read_text()
    assert [line.split(":")[0].strip() for line in written.splitlines() if line.startswith("  ")] == \
        ["sigterm", "ddp", "moe1", "parity", "mfu", "pp2", "moe2", "ckpt"], written
    assert written.index("  ckpt: ") < written.index("gpu-check summary")


def test_gpu_check_rows_pick_rows_and_order(gpu_machine):
    """ROWS= runs only the rows named, in that order (all: every row; unset: the GPU default, the 21 GB
    checkpoint row left for a second call); an unknown row is one line naming the rows there are."""
    gpu_check = bench_module("gpu_check")
    assert gpu_check.select_rows("moe1, sigterm", tiny=False) == ["moe1", "sigterm"]
    assert gpu_check.select_rows("all", tiny=False) == list(gpu_check.ROWS)
    assert gpu_check.select_rows(None, tiny=False) == ["sigterm", "ddp", "moe1", "parity", "mfu", "pp2", "moe2"]
    assert gpu_check.select_rows(None, tiny=True)[-1] == "ckpt"
    python, _, _ = gpu_machine
    bad = subprocess.run(["make", "-s", "gpu-check", "TINY=1", "ROWS=sigterm,mfuu", f"GPU_PY={python}"], cwd=ROOT,
                         env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "gpu-check: ROWS: unknown row mfuu (rows: sigterm, ddp, moe1, parity, mfu, pp2, moe2, ckpt, or all)" \
        in bad.stderr, bad.stderr


def test_the_checkpoint_row_checks_free_disk_first():
    """The 1.3B row keeps two 21 GB saves on disk: where there is less room it is a SKIP that says so."""
    gpu_check = bench_module("gpu_check")
    assert gpu_check.disk_shortfall(10**9, "/") == \
        f"needs 2200000 GB free in /, has {shutil.disk_usage('/').free / 1e9:.0f} GB"
    assert gpu_check.disk_shortfall(1, "/") is None


SAVE_DELAY_S = 40  # the SIGTERM save's commit marker is held this long: past torchrun's 30 s default


def test_a_sigterm_save_longer_than_30_s_completes_under_torch_2_11(gpu_machine, tmp_path, s3_server):
    """The pod (kubetron.launch, torchrun 2.11) is SIGTERMed mid-run; its save's commit marker takes 40 s to
    reach S3. The rank is not SIGKILLed at 30 s: the pod exits 75 (saved on signal) and the checkpoint is
    durable in the store."""
    python, _, site = gpu_machine
    store = f"s3://{s3_server.bucket}/grace-{time.monotonic_ns()}"
    marker = lambda method, path: method == "PUT" and path.endswith("/metadata.json")  # noqa: E731
    with FaultProxy(s3_server.endpoint, p_delay=1.0, delay_s=SAVE_DELAY_S, match=marker) as px:
        env = _clean_env(**s3_server.env(px.endpoint), PYTHONPATH=f"{site}{os.pathsep}{ROOT / 'trainer'}",
                         NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(free_port()), KUBETRON_TERMINATION_LOG=str(tmp_path / "termination-log"),
                         OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), **fault_at(3, "STOP"))
        pod = subprocess.Popen(
            [str(python), "-m", "kubetron.launch", "train", "--config", TINY, "train.train_iters=400",
             "logger.log_interval=1", "validation.eval_interval=null", f"checkpoint.save={store}",
             "checkpoint.save_interval=1000"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        out: list[str] = []
        signalled = None
        try:
            reader = LineReader(pod, out.append)  # the trainer stops itself at iteration 3; the SIGTERM meets it
            trainer = stopped_trainer(pod, 300, lambda: "".join(out)[-3000:])
            signalled = time.monotonic()
            sigterm_while_stopped(pod, trainer, 300)
            rc = pod.wait(timeout=300)
            reader.join(timeout=10)
        finally:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)
                pod.wait()
        took = time.monotonic() - (signalled or time.monotonic())
        delayed = px.stats["delay"]
    lines = "".join(out).splitlines()
    assert signalled is not None, lines[-30:]
    term = json.loads((tmp_path / "termination-log").read_text())
    assert rc == 75 and term["reason"] == "SavedOnSignal", (rc, term, lines[-30:])
    assert delayed == 1 and took > SAVE_DELAY_S, (delayed, took)  # the save really outlasted torchrun's 30 s
    it = term["lastCheckpoint"]
    tracker = s3_server.client().get_object(Bucket=s3_server.bucket, Key=f"{store.split('/', 3)[3]}/"
                                            "latest_train_state.pt")
    assert tracker["ContentLength"] > 0 and it >= 3, term
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(
        Bucket=s3_server.bucket, Prefix=store.split("/", 3)[3] + "/")["Contents"]]
    assert any(k.endswith(f"iter_{it:07d}/metadata.json") for k in keys), keys
