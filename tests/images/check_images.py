"""`make image-test`: build both images from the real Dockerfile with buildah and run what was built.

Where this runs there is no Docker daemon and no registry, and no container runtime can start a
container (podman/crun/runc fail to set rlimits); `buildah run --isolation chroot` can, sharing the
host's network. So:

1. tools     buildah and mmdebstrap, apt-get installed when missing (CI: a fresh machine, as root)
2. bases     Debian-packaged stand-ins for the Dockerfile's three bases (tests/images/standins.py)
3. build     `make image-operator` / `make image-trainer` (what `make images` runs) with buildah and
             --build-arg pointing at the stand-ins: kubetron-operator:dev, kubetron-trainer:dev
4. trainer   the trainer image, as its own user (10001) with a store mounted, trains the tiny GPT
             through its entry point (kubetron.launch -> torchrun -> kubetron train) and leaves
             checkpoints and progress.txt in the store, owned by 10001
5. operator  the operator image has no torch; its entry point, as 10001, reconciles a TrainingJob on
             a real control plane (tests/kube): the job's pods appear and its status follows them
6. sizes     of both images

Prints a PASS/FAIL line per phase with its time and exits 1 on any failure. Not collected by pytest
(the file name matches neither test_*.py nor *_test.py): `make test` never runs it.

    python -m tests.images.check_images --torch torch==2.13.0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.images import standins

ROOT = standins.ROOT
TAG = "dev"
TRAINER, OPERATOR = f"localhost/kubetron-trainer:{TAG}", f"localhost/kubetron-operator:{TAG}"
USER = "10001:10001"
POD = "gpt-1-0"  # the trainer container's hostname
TRAIN_ITERS, SAVE_INTERVAL = 20, 10
BUILD_TIMEOUT, RUN_TIMEOUT = 1800, 600  # seconds


class Failed(Exception):
    """A check did not hold: its message says what was expected and what was found."""


def expect(condition: Any, message: str) -> None:
    if not condition:
        raise Failed(message)


def sh(argv: list[str], timeout: float = RUN_TIMEOUT, log: Path | None = None, **kw: Any) -> str:
    """Run `argv` and return its output, which goes to `log` as it comes when given. A non-zero exit
    raises Failed with the output's tail."""
    with open(log, "w+") if log else tempfile.TemporaryFile("w+") as out:
        run = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL, **kw)
        out.seek(0)
        output = out.read()
    if run.returncode != 0:
        tail = "\n".join(output.splitlines()[-40:])
        raise Failed(f"`{' '.join(argv[:6])} ...` exited {run.returncode}:\n{tail}")
    return output


# -- phases ----------------------------------------------------------------------------------------------


def ensure_tools() -> str:
    """buildah and mmdebstrap; apt-get installs them where they are missing (needs root on Debian)."""
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        expect(os.geteuid() == 0 and shutil.which("apt-get"),
               f"{' and '.join(missing)} missing, and apt-get cannot install them here (needs root on Debian)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        sh(["apt-get", "update", "-q"], env=env)
        sh(["apt-get", "install", "-y", "-q", "buildah", "mmdebstrap"], env=env)
    return f"{sh(['buildah', '--version']).strip()}; mmdebstrap {sh(['mmdebstrap', '--version']).split()[-1]}"


def build(target: str, flags: list[str], log: Path) -> str:
    """`make image-<target>` with buildah (chroot isolation: RUN steps work where runc/crun cannot)."""
    image = f"localhost/kubetron-{target}:{TAG}"
    before = image_id(image)
    env = {**os.environ, "BUILDAH_ISOLATION": "chroot"}
    sh(["make", "-C", str(ROOT), f"image-{target}", "CONTAINER_TOOL=buildah", f"IMAGE_TAG={TAG}",
        f"IMAGE_BUILD_FLAGS={' '.join(flags)}"], timeout=BUILD_TIMEOUT, log=log, env=env)
    after = image_id(image)
    expect(after, f"make image-{target} succeeded but there is no {image}")
    if before and before != after:  # the previous build, now untagged: don't let reruns fill the disk
        subprocess.run(["buildah", "rmi", before], capture_output=True)
    return f"{image} {after[:12]}"


def check_trainer(work: Path, torch_version: str) -> str:
    """The trainer image trains the tiny GPT through its entry point as UID 10001, into a mounted store;
    its torch is the base's (`torch_version`), not one pip pulled over it."""
    entrypoint = check_config(TRAINER)
    expect(entrypoint[-2:] == ["-m", "kubetron.launch"], f"trainer entry point {entrypoint}")
    store = work / "store"
    with container(TRAINER, f"--add-host={POD}:127.0.0.1") as ctr:
        # The wheel stage compiled the async snapshot's copy (kubetron.checkpoint._hostcopy) with the base's gcc.
        probe = run_in(ctr, ["python3", "-c", "import kubetron.checkpoint._hostcopy, megatron.core, torch; "
                                              "print(torch.__version__, megatron.core.__version__)"])
        torch, megatron = probe.split()[-2:]
        expect(torch == torch_version, f"torch {torch}, not the base's {torch_version}")
        pinned = check_pins(ctr)
        t0 = time.monotonic()
        train(ctr, entrypoint, store, work)
        seconds = time.monotonic() - t0
    saved = check_store(store)
    return (f"torch {torch}, megatron-core {megatron}; {pinned} packages at constraints.txt's versions; "
            f"{TRAIN_ITERS} iterations in {seconds:.0f}s, saved {saved}")


def train(ctr: str, entrypoint: list[str], store: Path, work: Path) -> None:
    """`<entrypoint> train --config ...` as in a pod: the config mounted at /etc/kubetron, a store owned
    by the image's user, a termination log, a hostname /etc/hosts resolves (torchrun advertises it)."""
    etc = work / "etc-kubetron"
    etc.mkdir()
    shutil.copy(ROOT / "examples" / "tiny-gpt.yaml", etc / "config.yaml")
    store.mkdir()
    (store / "termination-log").touch()
    for path in (store, store / "termination-log"):
        os.chown(path, 10001, 10001)
    overrides = [f"train.train_iters={TRAIN_ITERS}", f"checkpoint.save_interval={SAVE_INTERVAL}",
                 f"validation.eval_interval={SAVE_INTERVAL}", "logger.log_interval=5",
                 "checkpoint.save=/store/tiny-gpt", "logger.tensorboard_dir=/store/tiny-gpt/tb"]
    options = [f"--volume={store}:/store", f"--volume={etc}:/etc/kubetron:ro", f"--hostname={POD}",
               "--env=KUBETRON_TERMINATION_LOG=/store/termination-log"]
    run_in(ctr, [*entrypoint, "train", "--config", "/etc/kubetron/config.yaml", *overrides], options,
           log=work / "trainer.log")


def check_store(store: Path) -> list[str]:
    """Checkpoints every SAVE_INTERVAL, the progress log, all owned by 10001; the termination message
    says done. Returns the checkpoints."""
    run_dir = store / "tiny-gpt"
    saved = sorted(p.name for p in run_dir.glob("iter_*"))
    want = [f"iter_{i:07d}" for i in range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL)]
    expect(saved == want, f"checkpoints in the store: {saved}, expected {want}")
    expect((run_dir / "progress.txt").is_file(), f"no progress.txt in {run_dir}: {os.listdir(run_dir)}")
    foreign = [str(p) for p in store.rglob("*") if p.lstat().st_uid != 10001]
    expect(not foreign, f"files in the store not owned by 10001: {foreign[:5]}")
    message = json.loads((store / "termination-log").read_text() or "{}")
    expect(message.get("exitCode") == 0, f"termination message: {message}")
    return saved


def check_operator(work: Path) -> str:
    """The operator image has no torch; its entry point, as 10001, reconciles a job on a real API server."""
    entrypoint = check_config(OPERATOR)
    expect(entrypoint == ["kubetron", "operator"], f"operator entry point {entrypoint}")
    with container(OPERATOR) as ctr:
        found = run_in(ctr, ["python3", "-c", "import importlib.util as u; print(u.find_spec('torch'))"]).strip()
        expect(found == "None", f"the operator image has torch: {found}")
        pinned = check_pins(ctr)
        pods = reconcile_one_job(ctr, entrypoint, work)
    return f"no torch; {pinned} packages at constraints.txt's versions; pods {pods} created, job Running"


def reconcile_one_job(ctr: str, entrypoint: list[str], work: Path) -> list[str]:
    """A real control plane (tests/kube, the chart's RBAC); the operator in the container with the chart's
    ServiceAccount's kubeconfig mounted; a TrainingJob applied: its pods appear, owned by it, and once
    they run (the test plays the kubelet) the job's status says Running. Returns the pods' names."""
    from tests.kube.cluster import NoBinaries, free_port, set_running, wait_for
    from tests.kube.fixtures import start_env
    from tests.operator.jobs import PVC_JOB, job_body

    try:
        cp, kube, kubelet = start_env(work / "kube")
    except NoBinaries as exc:
        raise Failed(str(exc)) from None
    try:
        ns = kube.namespace("img")
        mount = operator_kubeconfig(kube.kubeconfig, work / "kubeconfig")
        port, log = free_port(), work / "operator.log"
        argv = [*entrypoint, f"--liveness=http://127.0.0.1:{port}/healthz", "--interval=0.5", f"--namespace={ns}"]
        options = [f"--volume={mount}:/kube:ro", "--env=KUBECONFIG=/kube/kubeconfig"]
        with running_in(ctr, argv, options, log) as alive:
            wait_for("the operator's liveness endpoint", lambda: alive() and healthy(port), 120, 0.5,
                     explain=lambda: tail(log))
            body = job_body(PVC_JOB)
            body["metadata"] = {"name": "gpt", "namespace": ns}
            uid = kube.admin.create(kube.jobs(ns), body)["metadata"]["uid"]
            pods = kube.wait_pods(ns, {"gpt-1-0", "gpt-1-1"}, timeout=60)
            owners = {p["metadata"]["ownerReferences"][0]["uid"] for p in pods.values()}
            expect(owners == {uid}, f"pods owned by {owners}, not the job {uid}")
            for name in pods:
                set_running(kube.admin, ns, name)
            kube.wait_status(ns, "gpt", "phase Running", lambda s: s.get("phase") == "Running", timeout=60)
        expect("Traceback" not in log.read_text(errors="replace"), f"the operator logged a traceback:\n{tail(log)}")
    finally:
        kubelet.stop()
        cp.stop()
    return sorted(pods)


def check_config(image: str) -> list[str]:
    """The image runs as USER (numeric, non-root); returns its entry point."""
    config = image_config(image)
    expect(config.get("User") == USER, f"{image}'s USER is {config.get('User')!r}, not {USER}")
    return config.get("Entrypoint") or []


def check_pins(ctr: str) -> int:
    """Every installed package constraints.txt names is at its version (constraints.txt has no torch:
    the trainer's is the base's). Returns how many were checked."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, _, version = line.split("#", 1)[0].strip().partition("==")
        if version:
            pins[canonical(name)] = version
    # What the image's Python imports: the first distribution of each name on sys.path (venv, then base).
    listing = run_in(ctr, ["python3", "-c", "import importlib.metadata as m, json; "
                                            "print(json.dumps([[d.name, d.version] for d in m.distributions()]))"])
    found: dict[str, str] = {}
    for name, version in json.loads(listing.splitlines()[-1]):
        if canonical(name) in pins:
            found.setdefault(canonical(name), version)
    off = sorted(f"{name}=={version} (pinned {pins[name]})" for name, version in found.items()
                 if version != pins[name])
    expect(not off, f"installed at other versions than constraints.txt's: {off}")
    return len(found)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sizes() -> str:
    return ", ".join(f"{image} {image_size(image)}" for image in (OPERATOR, TRAINER))


# -- buildah helpers -------------------------------------------------------------------------------------


def image_id(image: str) -> str:
    run = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image],
                         capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else ""


def image_config(image: str) -> dict[str, Any]:
    return json.loads(sh(["buildah", "inspect", "--type", "image", image]))["OCIv1"]["config"]


def image_size(image: str) -> str:
    """As buildah reports it (uncompressed, e.g. "441 MB")."""
    (info,) = json.loads(sh(["buildah", "images", "--json", image]))
    return info["size"]


@contextlib.contextmanager
def container(image: str, *options: str) -> Iterator[str]:
    """A working container of `image`, removed afterwards whatever happens."""
    ctr = sh(["buildah", "from", "--pull-never", *options, image]).strip().splitlines()[-1]
    try:
        yield ctr
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)


def run_argv(ctr: str, argv: list[str], options: list[str]) -> list[str]:
    """`buildah run`: the image's user, environment and working directory, the host's network."""
    return ["buildah", "run", "--isolation=chroot", *options, ctr, "--", *argv]


def run_in(ctr: str, argv: list[str], options: list[str] = (), log: Path | None = None) -> str:
    return sh(run_argv(ctr, argv, list(options)), log=log)


@contextlib.contextmanager
def running_in(ctr: str, argv: list[str], options: list[str], log: Path) -> Iterator[Callable[[], bool]]:
    """`argv` in the container in the background until the block ends; yields 'is it still running'."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(run_argv(ctr, argv, options), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def alive() -> bool:
        if proc.poll() is not None:
            raise Failed(f"`{' '.join(argv)}` exited {proc.returncode}:\n{tail(log)}")
        return True
    try:
        yield alive
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group `buildah run` leads (its chrooted child is in it), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def operator_kubeconfig(kubeconfig: Path, mount: Path) -> Path:
    """A directory to mount at /kube: the operator's kubeconfig with its CA beside it,
    readable by UID 10001 (the test's own files are root's)."""
    mount.mkdir(mode=0o755)
    config = json.loads(kubeconfig.read_text())
    for cluster in config["clusters"]:
        shutil.copy(cluster["cluster"]["certificate-authority"], mount / "ca.crt")
        cluster["cluster"]["certificate-authority"] = "/kube/ca.crt"
    (mount / "kubeconfig").write_text(json.dumps(config))
    for path in mount.iterdir():
        path.chmod(0o644)
    return mount


def healthy(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# -- the run ---------------------------------------------------------------------------------------------


class Report:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, str]] = []
        self.t0 = time.monotonic()

    def phase(self, name: str, step: Callable[[], str], needs: tuple[str, ...] = ()) -> bool:
        failed_needs = [n for n in needs if not self.passed(n)]
        if failed_needs:
            self.rows.append((name, "FAIL", 0.0, f"not run: {', '.join(failed_needs)} failed"))
            print(f"[{name}] not run: {', '.join(failed_needs)} failed", flush=True)
            return False
        print(f"[{name}] ...", flush=True)
        t0 = time.monotonic()
        try:
            detail, result = step(), "PASS"
        except Failed as exc:
            detail, result = str(exc), "FAIL"
        except Exception:  # noqa: BLE001 - a crash of the driver is a failure to report, not a traceback to stop at
            detail, result = traceback.format_exc(), "FAIL"
        seconds = time.monotonic() - t0
        self.rows.append((name, result, seconds, detail))
        print(f"[{name}] {result} in {seconds:.0f}s: {detail}", flush=True)
        return result == "PASS"

    def passed(self, name: str) -> bool:
        return any(n == name and r == "PASS" for n, r, _, _ in self.rows)

    def summary(self) -> bool:
        ok = all(r == "PASS" for _, r, _, _ in self.rows)
        print("\n== make image-test ==")
        for name, result, seconds, detail in self.rows:
            print(f"  {result}  {name:<16} {seconds:6.0f}s  {detail.splitlines()[0] if detail else ''}")
        print(f"  {'PASS' if ok else 'FAIL'}  {'total':<16} {time.monotonic() - self.t0:6.0f}s")
        return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.images.check_images", description=__doc__.split("\n")[0])
    parser.add_argument("--torch", default="torch==2.13.0", help="the CPU torch of the trainer's stand-in base")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kubetron-image-test-"))
    work.chmod(0o755)  # UID 10001 inside the containers reaches the mounts below it
    report = Report()
    flags: list[str] = []

    def bases() -> str:
        flags.extend(standins.prepare(args.torch, sys.executable))
        return " ".join(f.split("=", 1)[1] for f in flags)

    report.phase("tools", ensure_tools)
    report.phase("bases", bases, needs=("tools",))
    report.phase("build operator", lambda: build("operator", flags, work / "build-operator.log"), needs=("bases",))
    report.phase("build trainer", lambda: build("trainer", flags, work / "build-trainer.log"), needs=("bases",))
    report.phase("trainer", lambda: check_trainer(work, standins.torch_version(args.torch)), needs=("build trainer",))
    report.phase("operator", lambda: check_operator(work), needs=("build operator",))
    report.phase("sizes", sizes, needs=("build operator", "build trainer"))
    ok = report.summary()
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    # A CI timeout's SIGTERM unwinds like an exception: containers and the control plane are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
