"""FSMWorker's options from vLLM's additional_config, else the environment (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.options import WorkerOptions


def config(section=None):
    return SimpleNamespace(additional_config={"runner_fsm": section} if section is not None else None)


def test_additional_config_wins_over_the_environment():
    env = {"RUNNER_FSM_RUN_DIR": "/env", "RUNNER_FSM_COLLECTIVE_TIMEOUT_S": "7", "RUNNER_FSM_INJECT": "desync@replica=1,step=3"}
    opts = WorkerOptions.from_vllm(config({"run_dir": "/cfg", "audit": "transitions"}), env)
    assert opts == WorkerOptions(run_dir="/cfg", run_id=None, collective_timeout_s=7.0,
                                 inject="desync@replica=1,step=3", audit="transitions")


def test_defaults_without_any_option():
    assert WorkerOptions.from_vllm(config(), {}) == WorkerOptions()


@pytest.mark.parametrize("section, message", [
    ({"graph_mode": "full"}, r"unknown keys \['graph_mode'\]"),
    ({"audit": "some"}, r"audit must be one of \['full', 'transitions'\], got 'some'"),
    ({"collective_timeout_s": "soon"}, "collective_timeout_s must be a number of seconds, got 'soon'"),
    ({"collective_timeout_s": 0}, "collective_timeout_s must be positive, got 0.0"),
])
def test_bad_options_are_refused_by_name(section, message):
    with pytest.raises(ConfigError, match=message):
        WorkerOptions.from_vllm(config(section), {})


@pytest.mark.parametrize("section, env, expected", [
    ({"fast_pcp_layout": True}, {}, True), ({"fast_pcp_layout": "false"}, {"RUNNER_FSM_FAST_PCP_LAYOUT": "1"}, False),
    ({}, {"RUNNER_FSM_FAST_PCP_LAYOUT": "on"}, True), ({}, {}, False)])
def test_fast_pcp_layout_is_opt_in(section, env, expected):
    assert WorkerOptions.from_vllm(config(section), env).fast_pcp_layout is expected


def test_a_fast_pcp_layout_that_is_no_flag_is_refused():
    with pytest.raises(ConfigError, match=r"fast_pcp_layout must be true or false, got 'sometimes'"):
        WorkerOptions.from_vllm(config({"fast_pcp_layout": "sometimes"}), {})


@pytest.mark.parametrize("section, env, cap, pinned", [
    ({}, {}, 2 << 30, 1000),  # the default cap (audit log, journal, Flight Recorder dump)
    ({"max_log_bytes": "64M", "pinned_steps": 50}, {"RUNNER_FSM_MAX_LOG_BYTES": "1G"}, 64 << 20, 50),
    ({}, {"RUNNER_FSM_MAX_LOG_BYTES": "0", "RUNNER_FSM_PINNED_STEPS": "7"}, None, 7),  # 0: one file, no cap
    ({"max_log_bytes": 1 << 20}, {}, 1 << 20, 1000)])
def test_the_log_cap(section, env, cap, pinned):
    opts = WorkerOptions.from_vllm(config(section), env)
    assert (opts.max_log_bytes, opts.pinned_steps) == (cap, pinned)


@pytest.mark.parametrize("section, message", [
    ({"max_log_bytes": "lots"}, r"max_log_bytes: expected a byte count such as 2G"),
    ({"pinned_steps": -1}, r"pinned_steps must be a number of steps >= 0, got -1")])
def test_a_bad_log_cap_is_refused_by_name(section, message):
    with pytest.raises(ConfigError, match=message):
        WorkerOptions.from_vllm(config(section), {})


def test_compressed_logs_are_opt_in():
    assert WorkerOptions.from_vllm(config(), {}).compress_logs is False
    assert WorkerOptions.from_vllm(config(), {"RUNNER_FSM_COMPRESS_LOGS": "1"}).compress_logs is True
