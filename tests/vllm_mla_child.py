"""Child process of test_vllm_mla_pcp.py: MLA through FSMWorker on Model Runner V2, one `LLM`
after another in this process (imports paid once), greedy with logprobs.

    python tests/vllm_mla_child.py SPEC_JSON   (environment: MRV2, see the test)
SPEC: {"model": dir, "prompts": {name: ids}, "new_tokens": n, "runs": [{"name", "pcp", "run_dir",
"options", "llm"?}]} (`llm`: more `LLM(...)` arguments, e.g. the device tests' graphs). Prints `RESULT {name: {"tokens": {...}, "logprobs": {...}}}`.
"""

from __future__ import annotations

import json
import sys


def main(spec: dict) -> dict:
    from vllm import SamplingParams

    import vllm_harness as h
    from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE

    names = list(spec["prompts"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, logprobs=1)
    out = {}
    for run in spec["runs"]:
        kwargs = h.llm_kwargs(spec["model"], run_dir=run["run_dir"], block_size=MLA_BLOCK_SIZE,
                              max_num_batched_tokens=256, prefill_context_parallel_size=run["pcp"],
                              enable_prefix_caching=False, runner_fsm=run.get("options"), **run.get("llm", {}))
        with h.open_llm(**kwargs) as llm:
            outs = llm.generate([{"prompt_token_ids": spec["prompts"][n]} for n in names], params, use_tqdm=False)
        out[run["name"]] = {
            "tokens": {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs)},
            "logprobs": {n: [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for n, o in zip(names, outs)}}
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
