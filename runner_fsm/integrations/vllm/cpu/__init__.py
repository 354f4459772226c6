"""Fixes for vLLM 0.32 on its CPU platform, each installed only where the installed vLLM needs it:
`collectives` (the MoE exchange collectives `CpuCommunicator` lacks under DP) and `rope` (a
stride-safe rotary embedding for MLA)."""
