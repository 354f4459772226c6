"""Integrations of the runner into other engines (`runner_fsm.integrations.vllm`)."""
