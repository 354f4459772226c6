"""Stand-in for vllm/entrypoints/cli/serve.py (0.33.0): `ServeSubcommand`'s three methods the
package calls (serve.py:54, 158, 161), recording what they were given."""

import argparse

from vllm.entrypoints.common import startup


class ServeSubcommand:
    name = "serve"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        startup.CALLS.append(f"serve {args.model_tag} dp={args.data_parallel_size}")

    def validate(self, args: argparse.Namespace) -> None:
        startup.CALLS.append("validate")

    def subparser_init(self, subparsers):
        parser = subparsers.add_parser(self.name)
        parser.add_argument("model_tag", nargs="?")
        parser.add_argument("--data-parallel-size", type=int, default=1)
        return parser
