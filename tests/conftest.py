"""Fixtures shared by the test files that run the real model end to end."""

import os
import signal

import pytest

# A launcher that ignores SIGINT (a background job of a non-interactive shell, nohup, many CI
# runners) leaves it ignored in every process it starts; a process started from a terminal has
# it as Python sets it. The suite runs as if started from a terminal: its own SIGINT is Python's
# (`KeyboardInterrupt`), so every process it starts gets SIGINT's default action again (exec
# resets a caught signal, never an ignored one), and the tests of Ctrl-C test what users meet.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # an int as inherited, not the enum: ==
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Which vLLM model runner the `vllm` tests run on: `make test-vllm` runs them on V1, then again on
# Model Runner V2 (`make test-vllm-mrv2`: VLLM_USE_V2_MODEL_RUNNER=1, Triton's interpreter and the
# stand-in backend of tests/vllm_site). Tests compare the runner FSMWorker logged with this.
EXPECTED_RUNNER = "mrv2" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" else "v1"


# `make test-times`: each test phase's duration (setup: the fixtures it is the first to need, such
# as model builds and engine start-ups; call; teardown), one JSON line each, into a file per pytest
# session in this directory, named after the tier (its -m expression and model runner), and at the
# session's end one `session` line: its wall time and how many tests ran at once (pytest-xdist's
# workers; 1 without). tests/time_table.py turns them into the table in tests/README.md. Under
# xdist only the controller writes: it gets every worker's reports through the same hook.
_TIMES_DIR = os.environ.get("RUNNER_FSM_TEST_TIMES")
_times_file = None
_session_started = 0.0


def pytest_configure(config):
    global _times_file, _session_started
    if _TIMES_DIR and not hasattr(config, "workerinput"):
        import re
        import time
        from pathlib import Path

        tier = (config.option.markexpr or "all") + ("+mrv2" if EXPECTED_RUNNER == "mrv2" else "")
        name = re.sub(r"[^A-Za-z0-9+]+", "_", tier).strip("_")
        Path(_TIMES_DIR).mkdir(parents=True, exist_ok=True)
        _times_file = open(Path(_TIMES_DIR) / f"{name}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - session-long
        _session_started = time.monotonic()


def pytest_runtest_logreport(report):
    if _times_file is not None:
        import json

        _times_file.write(json.dumps({"test": report.nodeid, "when": report.when, "s": round(report.duration, 3),
                                      "outcome": report.outcome}) + "\n")
        _times_file.flush()


def pytest_sessionfinish(session):
    if _times_file is not None:
        import json
        import time

        workers = getattr(session.config.option, "numprocesses", None) or 1
        _times_file.write(json.dumps({"session": True, "wall_s": round(time.monotonic() - _session_started, 1),
                                      "workers": workers}) + "\n")
        _times_file.flush()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """A tiny random Mixtral target and draft (HF format), made once per test session."""
    from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, make_random_model

    root = tmp_path_factory.mktemp("models")
    make_random_model(root / "target", TARGET_SPEC, seed=11)
    make_random_model(root / "draft", DRAFT_SPEC, seed=12)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(autouse=True)
def _vllm_must_import(request):
    """A `vllm`-marked test fails (never skips) when vLLM cannot be imported in this venv, or runs
    on another model runner or platform than its leg's (before pytest the Makefile's vLLM targets
    only look for the package: a check there that imported vLLM cost 7 to 9 s of CPU here)."""
    if request.node.get_closest_marker("vllm") is not None:
        import vllm  # noqa: F401  - an ImportError here is the test's failure

        if EXPECTED_RUNNER == "mrv2":  # the MRV2 leg fails, never falls back to V1 unseen
            from vllm.triton_utils import HAS_TRITON

            assert HAS_TRITON, ("the MRV2 leg needs vLLM's Triton check to pass: run it as `make test-vllm-mrv2`"
                                " (PYTHONPATH=tests/vllm_site, TRITON_INTERPRET=1)")
        if request.node.get_closest_marker("device") is not None:  # never the CPU platform unseen
            from vllm.platforms import current_platform

            assert getattr(current_platform, "emulated_device", False), (
                "the device tests need RUNNER_FSM_EMULATE_DEVICE=1 before vLLM starts: run `make test-vllm-device`")


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory):
    """Tiny random Llama, Mixtral and Qwen3-MoE checkpoints (transformers, no network)."""
    from runner_fsm.testing.vllm_models import ARCHITECTURES, make_model

    root = tmp_path_factory.mktemp("vllm-models")
    return {arch: make_model(root / arch, arch, seed=3) for arch in ARCHITECTURES}
