# syntax=docker/dockerfile:1
#
# Two images from one file:
#   docker build --target operator -t kubetron-operator:dev .
#   docker build --target trainer  -t kubetron-trainer:dev .
# (`make images` runs both.) Neither image contains credentials: S3 keys reach the trainer pods at run
# time from the Secret a TrainingJob names (see examples/trainingjob-s3.yaml).

# The trainer's base: an NGC PyTorch image, which ships CUDA, NCCL, PyTorch and TransformerEngine.
# Override with --build-arg BASE_IMAGE=... (any image with torch; TransformerEngine is optional).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The wheel is built where there is a C compiler (the full image, not slim): setup.py's optional
# extension kubetron._hostcopy, the async snapshot's copy (twice libc's speed), is compiled into it
# (the limited API: one build serves the trainer image's Python too).
ARG WHEEL_IMAGE=python:3.12-bookworm

# ---------------------------------------------------------------------------------------------------
# wheel: build kubetron once; the two images install the same wheel with different extras.
FROM ${WHEEL_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY trainer/ trainer/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && basename /wheels/kubetron-*.whl > /wheels/NAME

# ---------------------------------------------------------------------------------------------------
# operator: kopf + the kubernetes client; no torch. `kubetron operator` is the kopf entry point.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A fixed numeric UID so the pod's runAsNonRoot check can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 kubetron \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kubetron
# Pinned: the versions CI tested the operator with (constraints.txt, `make constraints`).
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=constraints.txt,target=/tmp/constraints.txt \
    pip install --no-cache-dir -c /tmp/constraints.txt "/wheels/$(cat /wheels/NAME)[operator]"
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
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/kubetron
# NGC images pin their torch/TransformerEngine builds in /etc/pip/constraint.txt (PIP_CONSTRAINT),
# so this install keeps the image's CUDA torch instead of pulling a wheel from PyPI. (Not our
# constraints.txt: its numpy & co. pins would replace the builds NGC tested its torch with.)
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "/wheels/$(cat /wheels/NAME)[trainer]" \
        "megatron-core==${MEGATRON_CORE_VERSION}"
# HOME is writable by any UID (sticky, like /tmp): a pod's securityContext.runAsUser may pick another
# non-root UID than this image's, and torch/triton still need a cache directory.
RUN groupadd --system --gid 10001 kubetron \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kubetron \
       --shell /bin/bash kubetron \
    && chmod 1777 /home/kubetron
WORKDIR /home/kubetron
USER 10001:10001
ENTRYPOINT ["python3", "-m", "kubetron.launch"]
