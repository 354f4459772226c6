"""Stand-in: vLLM 0.33.0's version only (tests/vllm033_standin/README.md)."""
__version__ = "0.33.0"
