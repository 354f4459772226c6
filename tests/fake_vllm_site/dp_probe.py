"""A rank's work under the stand-in vLLM (`Job.run`): what the rank saw, as its `extra`; a rank
whose requests ask for it raises, as a worker's fault ends a rank."""

import os
import sys


def serve(llm, requests):
    if any(r.req_id == "raise" for r in requests):
        raise RuntimeError("the probe's fault on this rank")
    seen = {"pid": os.getpid(), "ppid": os.getppid(), "dp_rank": os.environ.get("VLLM_DP_RANK"),
            "dp_rank_local": os.environ.get("VLLM_DP_RANK_LOCAL"), "dp_size": os.environ.get("VLLM_DP_SIZE"),
            "port": os.environ.get("VLLM_DP_MASTER_PORT"), "cwd": os.getcwd()}
    print(f"probe on rank {seen['dp_rank']}")  # into the rank's own log
    sys.stdout.flush()
    return {r.req_id: list(r.prompt) for r in requests}, 0.0, seen
