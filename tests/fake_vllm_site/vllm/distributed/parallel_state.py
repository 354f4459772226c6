"""Stand-in (see vllm/__init__.py): no process group is ever made here."""


def model_parallel_is_initialized() -> bool:
    return False


def cleanup_dist_env_and_memory() -> None:
    raise AssertionError("nothing to clean up: close_llm must not call it")
