"""Stand-in for vllm/entrypoints/common/startup.py (0.33.0), where `cli_env_setup` moved
(startup.py:131; 0.32 had it in entrypoints/serve/utils/api_utils.py, which this tree lacks)."""

CALLS: list[str] = []


def cli_env_setup():
    CALLS.append("cli_env_setup")
