"""Stand-in for vllm/utils/argparse_utils.py (0.33.0): `FlexibleArgumentParser` (line 156)."""

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    pass
