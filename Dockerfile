# syntax=docker/dockerfile:1
#
# Two images from one file, built by Docker (BuildKit), podman or buildah:
#   docker build --target operator -t kubetron-operator:dev .
#   docker build --target trainer  -t kubetron-trainer:dev .
# (`make images` runs both with whichever of the three the machine has.) Neither image contains
# credentials: S3 keys reach the trainer pods at run time from the Secret a TrainingJob names (see
# examples/trainingjob-s3.yaml).
#
# Each image installs into a virtualenv (/opt/kubetron), so one file serves the official bases named
# below (whose Python allows system-wide installs) and a distribution's Python, which refuses them
# (PEP 668): `make image-test` builds this file on Debian-packaged stand-ins for the three bases.

# The trainer's base: an NGC PyTorch image, which ships CUDA, NCCL, PyTorch and TransformerEngine.
# Override with --build-arg BASE_IMAGE=... (any image with torch and pip; TransformerEngine is optional).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The wheel is built where there is a C compiler (the full image, not slim): setup.py's optional
# extension kubetron.checkpoint._hostcopy, the async snapshot's copy (without it ctypes.memmove: 1.4-1.6x the
# blocked time, README), is compiled into it (the limited API: one build serves the trainer's Python too).
ARG WHEEL_IMAGE=python:3.12-bookworm

# ---------------------------------------------------------------------------------------------------
# wheel: build kubetron once; the two images install the same wheel with different extras.
FROM ${WHEEL_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && basename /wheels/kubetron-*.whl > /wheels/NAME

# ---------------------------------------------------------------------------------------------------
# operator: kopf + the kubernetes client; no torch. `kubetron operator` is the kopf entry point.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kubetron \
    PATH=/opt/kubetron/bin:$PATH
# A fixed numeric UID so the pod's runAsNonRoot check can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 kubetron \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kubetron
# Pinned: the versions CI tested the operator with (constraints.txt, `make constraints`).
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=constraints.txt,target=/tmp/constraints.txt \
    python3 -m venv /opt/kubetron \
    && /opt/kubetron/bin/python -m pip install --no-cache-dir -c /tmp/constraints.txt \
       "/wheels/$(cat /wheels/NAME)[operator]"
USER 10001:10001
# kopf's liveness endpoint (the chart probes /healthz here) and /metrics (--metrics-port, chart metrics.port).
EXPOSE 8080 8081
ENTRYPOINT ["kubetron", "operator"]
CMD ["--liveness=http://0.0.0.0:8080/healthz"]

# ---------------------------------------------------------------------------------------------------
# trainer: kubetron[trainer] + megatron-core on the NGC image. The entry point is the launcher, which
# runs `torchrun -m kubetron train ...` with the rendezvous the operator put in the environment
# (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT) and exits with the trainer's own code.
FROM ${BASE_IMAGE} AS trainer
ARG MEGATRON_CORE_VERSION=0.16.1
# Which versions of the rest: on NGC, the image's own pins (/etc/pip/constraint.txt, PIP_CONSTRAINT)
# keep the torch/TransformerEngine builds and the numpy & co. NVIDIA tested them with; our
# constraints.txt would fight those, so by default none is added. On a base without such pins (the
# CPU stand-in `make image-test` builds), --build-arg PIN_CONSTRAINTS=1 installs everything but the
# base's torch at the versions CI tested (constraints.txt carries no torch pin).
ARG PIN_CONSTRAINTS=
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/kubetron \
    VIRTUAL_ENV=/opt/kubetron \
    PATH=/opt/kubetron/bin:$PATH
# --system-site-packages: the venv sees the base's torch (and TransformerEngine), so pip keeps them
# instead of pulling a torch wheel from PyPI. --without-pip: the base's pip installs into the venv
# (a venv's own pip needs ensurepip, which Debian/Ubuntu Pythons ship apart).
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=constraints.txt,target=/tmp/constraints.txt \
    python3 -m venv --system-site-packages --without-pip /opt/kubetron \
    && /opt/kubetron/bin/python -m pip install --no-cache-dir ${PIN_CONSTRAINTS:+-c /tmp/constraints.txt} \
       "/wheels/$(cat /wheels/NAME)[trainer]" "megatron-core==${MEGATRON_CORE_VERSION}"
# HOME is writable by any UID (sticky, like /tmp): a pod's securityContext.runAsUser may pick another
# non-root UID than this image's, and torch/triton still need a cache directory.
RUN groupadd --system --gid 10001 kubetron \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kubetron \
       --shell /bin/bash kubetron \
    && chmod 1777 /home/kubetron
WORKDIR /home/kubetron
USER 10001:10001
ENTRYPOINT ["python3", "-m", "kubetron.launch"]
