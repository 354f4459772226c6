"""A stand-in `vllm` for tests/test_offline_dp_launch.py: the offline DP launcher's process
design (who imports vLLM, who forks the ranks, what each rank sees) without vLLM's cost. Each
import appends the importing process's pid to $FAKE_VLLM_IMPORTS. Never on the package's path."""

import os


def _record_import() -> None:
    with open(os.environ["FAKE_VLLM_IMPORTS"], "a") as f:
        f.write(f"{os.getpid()}\n")


_record_import()


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Core:
    def shutdown(self) -> None:
        pass


class _Engine:
    engine_core = _Core()


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = _Engine()
