"""Stand-ins, made from Debian packages, for the three base images the Dockerfile names.

No registry is reachable where `make image-test` runs, so `python:3.12-slim-bookworm`,
`python:3.12-bookworm` and the NGC PyTorch image cannot be pulled. Each stand-in plays one of them
with Debian bookworm's Python (3.11), and keeps what makes the Dockerfile's job harder, not easier:
that Python refuses system-wide pip installs (PEP 668), and nothing is there that the recipe does
not ask for.

    PYTHON_IMAGE  python   python3 + venv, passwd (groupadd/useradd)          ~ python:3.12-slim
    WHEEL_IMAGE   wheel    + pip, gcc, Python headers                          ~ python:3.12 (full)
    BASE_IMAGE    torch    python3 + pip, torch's CPU wheel installed system-wide  ~ NGC PyTorch

`mmdebstrap` writes each root filesystem as a tarball, cached under ~/.cache/kubetron/images by a
hash of its recipe (packages, options, the torch wheel, constraints.txt): a second local run skips
it. buildah pulls the tarball as the layer of an OCI image layout, with a second layer holding the
building machine's CA bundle (pip inside the builds may reach PyPI through a TLS-inspecting proxy),
as `localhost/kubetron-standin-<name>:<hash>`; a run that finds that image skips the import too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.kube.cluster import CACHE

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = CACHE / "images"
SUITE = "bookworm"  # its python3 is 3.11: the torch wheel's cp311, and megatron-core 0.16.1 (the Dockerfile's pin)
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What every stand-in is made with: Debian's minimal base, without docs, man pages and translations
# (as Debian's -slim images), and apt retrying a flaky mirror.
MMDEBSTRAP_OPTIONS = ("--variant=minbase", '--aptopt=Acquire::Retries "3"',
                      *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale", "info")),
                      "--dpkgopt=path-include=/usr/share/doc/*/copyright")


@dataclass(frozen=True)
class Recipe:
    name: str
    build_arg: str  # the Dockerfile ARG this stand-in fills
    packages: tuple[str, ...]
    installs_torch: bool = False


RECIPES = (
    Recipe("python", "PYTHON_IMAGE", ("python3", "python3-venv", "ca-certificates", "passwd")),
    Recipe("wheel", "WHEEL_IMAGE", ("python3", "python3-pip", "python3-dev", "gcc", "libc6-dev", "ca-certificates")),
    # No python3-venv: like NGC's Ubuntu Python, it has pip but no ensurepip.
    Recipe("torch", "BASE_IMAGE", ("python3", "python3-pip", "ca-certificates", "passwd"), installs_torch=True),
)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def torch_version(spec: str) -> str:
    """The torch the stand-in gets for `spec` (torch==2.13.0, the Makefile's): its CPU build, never a
    CUDA one (the stand-in has no CUDA)."""
    version = spec.split("==", 1)[1]
    return version if "+" in version else f"{version}+cpu"


def torch_wheel(spec: str, python: str) -> Path:
    """The CPU torch wheel for the stand-in's Python 3.11, fetched by the host's pip: its config's
    find-links holds the local CPU build."""
    dest = CACHE_DIR / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    version = torch_version(spec)
    subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.11", "--implementation=cp", "--abi=cp311",
                    "--platform=manylinux_2_28_x86_64", f"--dest={dest}", f"torch=={version}"], check=True)
    (wheel,) = dest.glob(f"torch-{version}-cp311-*.whl")
    return wheel


def _pip_install(wheel_name: str) -> str:
    """The torch install inside the chroot: into its system Python (PEP 668 lifted for this one
    install, as NGC's image has its torch system-wide), other packages pinned by constraints.txt."""
    return ("env -i PATH=" + PATH + " HOME=/root python3 -m pip install --break-system-packages --no-cache-dir"
            " --cert /tmp/ca-certificates.crt -c /tmp/constraints.txt /tmp/" + shlex.quote(wheel_name))


def mmdebstrap_argv(recipe: Recipe, wheel: Path | None, out: Path) -> list[str]:
    argv = ["mmdebstrap", *MMDEBSTRAP_OPTIONS, f"--include={','.join(recipe.packages)}"]
    if recipe.installs_torch:
        assert wheel is not None
        argv += [f"--customize-hook=copy-in {shlex.quote(str(wheel))} {ROOT / 'constraints.txt'} {HOST_CA} /tmp",
                 f'--customize-hook=chroot "$1" {_pip_install(wheel.name)}',
                 '--customize-hook=rm -f "$1"/tmp/*.whl "$1"/tmp/constraints.txt "$1"/tmp/ca-certificates.crt']
    return [*argv, SUITE, str(out)]


def recipe_key(recipe: Recipe, wheel: Path | None) -> str:
    """Changes when anything the tarball is made of changes (not with where the files lie)."""
    parts: dict[str, object] = {"suite": SUITE, "options": MMDEBSTRAP_OPTIONS, "packages": recipe.packages}
    if recipe.installs_torch:
        assert wheel is not None
        parts.update(pip=_pip_install(wheel.name), wheel_size=wheel.stat().st_size,
                     constraints=sha256(ROOT / "constraints.txt"))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def image_exists(ref: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True).returncode == 0


@dataclass
class Standin:
    recipe: Recipe
    tarball: Path
    image: str
    proc: subprocess.Popen | None = None
    log: Path | None = None


def plan(wheel: Path) -> list[Standin]:
    ca = sha256(HOST_CA)[:16]
    out = []
    for recipe in RECIPES:
        key = recipe_key(recipe, wheel if recipe.installs_torch else None)
        tag = hashlib.sha256(f"{key}{ca}".encode()).hexdigest()[:16]
        out.append(Standin(recipe, CACHE_DIR / f"{recipe.name}-{key}.tar",
                           f"localhost/kubetron-standin-{recipe.name}:{tag}"))
    return out


def make_tarballs(standins: list[Standin], wheel: Path) -> None:
    """Run mmdebstrap for each missing tarball, all at once (mostly download and unpack)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    for s in standins:
        if s.tarball.exists() or image_exists(s.image):
            print(f"  {s.recipe.name}: cached ({s.tarball.name})")
            continue
        partial = s.tarball.with_suffix(".partial.tar")
        s.log = s.tarball.with_suffix(".log")
        argv = mmdebstrap_argv(s.recipe, wheel, partial)
        print(f"  {s.recipe.name}: mmdebstrap ... (log {s.log})")
        with open(s.log, "wb") as log:
            s.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    failed = []
    for s in standins:
        if s.proc is None:
            continue
        if s.proc.wait() != 0:
            failed.append(f"{s.recipe.name}: mmdebstrap exited {s.proc.returncode}:\n"
                          + "\n".join(s.log.read_text(errors="replace").splitlines()[-30:]))
            continue
        s.tarball.with_suffix(".partial.tar").rename(s.tarball)
    if failed:
        raise RuntimeError("\n".join(failed))


def _blob(layout: Path, data: bytes | None = None, path: Path | None = None) -> dict[str, object]:
    """Put a blob into an OCI layout (a file is hard-linked, not copied); its descriptor fields."""
    digest = hashlib.sha256(data).hexdigest() if data is not None else sha256(path)
    target = layout / "blobs" / "sha256" / digest
    if data is not None:
        target.write_bytes(data)
    else:
        os.link(path, target)
    return {"digest": f"sha256:{digest}", "size": target.stat().st_size}


def _ca_layer() -> bytes:
    """A layer holding this machine's CA bundle (pip inside the builds reaches PyPI through it)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tar.gettarinfo(str(HOST_CA), arcname=str(HOST_CA).lstrip("/"))
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        with open(HOST_CA, "rb") as f:
            tar.addfile(info, f)
    return out.getvalue()


def _oci_layout(s: Standin, layout: Path) -> None:
    """The tarball as an OCI image layout (one layer, plus the CA layer): buildah pulls it in one pass,
    where `buildah add` + `commit` would unpack and pack it again."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    ca = _ca_layer()
    layers = [_blob(layout, path=s.tarball), _blob(layout, data=ca)]
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": [f"PATH={PATH}", "LANG=C.UTF-8"], "Cmd": ["/bin/bash"],
                         "Labels": {"dev.kubetron.standin": s.recipe.name}},
              "rootfs": {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           **_blob(layout, data=json.dumps(config).encode())},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer} for layer in layers]}
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                **_blob(layout, data=json.dumps(manifest).encode())}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def import_image(s: Standin) -> None:
    """The tarball as the image `s.image`, unless buildah's storage has it already."""
    if image_exists(s.image):
        return
    t0 = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix="import-", dir=CACHE_DIR))  # beside the tarball: hard links
    name = f"kubetron-standin-{s.recipe.name}"
    try:
        _oci_layout(s, staging / name)
        # buildah 1.28 names an image pulled from a layout after its path: a relative one gives localhost/<name>.
        _buildah("pull", "--quiet", f"oci:{name}", cwd=staging)
        _buildah("tag", f"localhost/{name}:latest", s.image)
        _buildah("rmi", f"localhost/{name}:latest")  # only the name goes: the image keeps s.image
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"  {s.recipe.name}: imported as {s.image} ({time.monotonic() - t0:.0f}s)")


def _buildah(*args: str, cwd: Path | None = None) -> None:
    run = subprocess.run(["buildah", *args], cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)} exited {run.returncode}: {run.stderr.strip()}")


def build_args(standins: list[Standin]) -> list[str]:
    """The Dockerfile's base-image args, and PIN_CONSTRAINTS: the torch stand-in has no pins of its own
    (NGC's /etc/pip/constraint.txt), so the trainer installs at constraints.txt's versions."""
    return [f"--build-arg={s.recipe.build_arg}={s.image}" for s in standins] + ["--build-arg=PIN_CONSTRAINTS=1"]


def prepare(torch_spec: str, python: str) -> list[str]:
    """Make (or reuse) the three stand-ins; the --build-arg flags that point the Dockerfile at them."""
    wheel = torch_wheel(torch_spec, python)
    standins = plan(wheel)
    make_tarballs(standins, wheel)
    for s in standins:
        import_image(s)
    return build_args(standins)


if __name__ == "__main__":  # python -m tests.images.standins torch==2.13.0: make them, print the flags
    import sys

    print(" ".join(prepare(sys.argv[1], sys.executable)))
