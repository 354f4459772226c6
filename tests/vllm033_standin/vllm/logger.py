"""Stand-in for vllm/logger.py (0.33.0): `configure_logging_from_args` (logger.py:312)."""


def configure_logging_from_args(args):
    from vllm.entrypoints.common import startup

    startup.CALLS.append("configure_logging_from_args")
