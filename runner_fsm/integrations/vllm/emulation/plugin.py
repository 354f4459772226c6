"""The `vllm.platform_plugins` entry point: the emulated device platform where it is asked for.

vLLM calls every platform plugin at start-up in each of its processes and uses the one
out-of-tree plugin that answers a class name; `None` leaves vLLM's own choice. It answers only
under `RUNNER_FSM_EMULATE_DEVICE=1` (and never where `VLLM_TARGET_DEVICE=cpu` pins vLLM's own
CPU platform: vLLM asks no plugin then)."""

from __future__ import annotations

from runner_fsm.integrations.vllm.emulation import enabled

PLATFORM = "runner_fsm.integrations.vllm.emulation.platform.EmulatedDevicePlatform"


def platform() -> str | None:
    return PLATFORM if enabled() else None
