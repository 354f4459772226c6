"""Model Runner V2's PCP manager (`vllm/v1/worker/gpu/pcp_manager.py`) as the MRV2 adapter reads it:
`evidence` (what each forward's PCP context and buffers are, for replay), `layout` (the opt-in
compiled layout installed on one manager instance) and `segments` (its rank segments). Every name
read from the manager is in `evidence.MANAGER_NAMES` or `layout.MANAGER_NAMES`."""
