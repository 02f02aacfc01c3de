# The README's two commands: `make demo` and `make test`. Everything else is for developers.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
# torch first, pinned: the CPU wheel on disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
# Every other package at the version CI tested (regenerate with `make constraints`).
PINNED := -c constraints.txt

.PHONY: demo test test-fast venv venv-dev lint chart images image-operator image-trainer image-test bench gpu-wheels gpu-check clean \
        constraints

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# setup.py builds the one C extension (kubetron.checkpoint._hostcopy) into the source tree: a changed source rebuilds.
$(VENV)/.trainer: pyproject.toml setup.py trainer/kubetron/checkpoint/_hostcopy.c constraints.txt | $(VENV)/bin/python
	$(PIP) $(TORCH)
	$(PIP) $(PINNED) -e '.[trainer]'
	touch $@

$(VENV)/.dev: pyproject.toml setup.py constraints.txt $(VENV)/.trainer
	$(PIP) $(PINNED) -e '.[trainer,operator,dev]'
	touch $@

venv: $(VENV)/.trainer
venv-dev: $(VENV)/.dev

## demo: set up .venv and train the tiny GPT on CPU (mock data, checkpoints in ./runs/demo)
demo: $(VENV)/.trainer
	rm -rf runs/demo
	$(VENV)/bin/kubetron train --config examples/tiny-gpt.yaml \
	    checkpoint.save=runs/demo logger.tensorboard_dir=runs/demo/tb

## test: set up .venv (if missing) and run the whole suite (every tier), in two pytest processes side by side
## (tests/suite.py; SERIAL=1: one pytest)
test: $(VENV)/.dev
	$(PY) -m tests.suite $(if $(SERIAL),--serial)

## test-fast: the unit tier only (no model trained, no process started), a developer's inner loop; TIER=trainer
## (or process, cluster; several: TIER="unit trainer") runs others
TIER ?= unit
test-fast: $(VENV)/.dev
	$(VENV)/bin/python -m pytest -q tests $(addprefix --tier ,$(TIER))

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check trainer operator tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/python -m kubetron_operator.helm lint charts/kubetron

chart: $(VENV)/.dev
	$(VENV)/bin/python -m kubetron_operator.helm package charts/kubetron dist/

## images: kubetron-operator:dev and kubetron-trainer:dev, built by Docker (when its daemon answers), else
## podman, else buildah. CONTAINER_TOOL=docker|podman|buildah picks one; IMAGE_TAG (dev) names the tag;
## IMAGE_BUILD_FLAGS adds flags, e.g. IMAGE_BUILD_FLAGS='--build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3'.
IMAGE_TAG         ?= dev
IMAGE_BUILD_FLAGS ?=
ifeq ($(origin CONTAINER_TOOL),undefined)
# Looked up once, and only when an image target needs it.
CONTAINER_TOOL = $(eval CONTAINER_TOOL := $(shell \
    if docker info >/dev/null 2>&1; then echo docker; \
    elif command -v podman >/dev/null 2>&1; then echo podman; \
    elif command -v buildah >/dev/null 2>&1; then echo buildah; fi))$(CONTAINER_TOOL)
endif

images: image-operator image-trainer

image-operator image-trainer: image-%:
	$(if $(CONTAINER_TOOL),,$(error make images: no Docker daemon, podman or buildah found; install one or set CONTAINER_TOOL=))
	$(CONTAINER_TOOL) build --target $* -t kubetron-$*:$(IMAGE_TAG) $(IMAGE_BUILD_FLAGS) .

## image-test: build both images with buildah on Debian-packaged stand-ins for their bases, then run them:
## the trainer trains the tiny GPT, the operator reconciles a job on a real API server (tests/images/).
image-test: $(VENV)/.dev
	$(PY) -m tests.images.check_images --torch '$(TORCH)'

bench: $(VENV)/.trainer
	$(PY) bench/loop_overhead.py
	$(PY) bench/checkpoint.py

## constraints: re-pin constraints.txt from the current .venv (after changing pyproject.toml ranges)
constraints: $(VENV)/.dev
	{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.new
	mv constraints.new constraints.txt

## gpu-wheels: here (with network), the wheels a GPU machine lacks (megatron-core, pydantic, boto3 and their
## dependencies), pinned by constraints.txt, for its Python (GPU_PYTHON_VERSION), into WHEEL_DIR (.whl/, ignored).
## gpu-check: there, the GPU path's checks: each row printed as it ends (and into $OUT/gpu-check.txt when OUT is
## set), then one table. Without a .venv it uses python3 and installs .whl/ into a side directory first.
## ROWS=sigterm,ddp,... picks rows and their order (bench/gpu_check.py); TINY=1: the CPU dry run CI runs.
TINY   ?=
ROWS   ?=
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_PYTHON_VERSION ?= 3.12
WHEEL_DIR ?= .whl
GPU_WHEELS ?= $(if $(wildcard $(PY)),,$(wildcard $(WHEEL_DIR)))
gpu-wheels:
	$(PYTHON) bench/gpu_wheels.py download --python-version $(GPU_PYTHON_VERSION) --dest $(WHEEL_DIR)

gpu-check:
	TINY=$(TINY) ROWS=$(ROWS) $(GPU_PY) bench/gpu_check.py $(if $(GPU_WHEELS),--wheels $(GPU_WHEELS))

clean:
	rm -rf $(VENV) runs build dist *.egg-info
