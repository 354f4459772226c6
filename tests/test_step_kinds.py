"""`StepKinds`: which vLLM steps prefill, from scheduler outputs (stand-ins with vLLM's field
names): chunked prompts, prefix-cached ones, resumed requests, finished ones, mixed batches."""

from __future__ import annotations

from types import SimpleNamespace

from runner_fsm.integrations.vllm.recording.step_kinds import StepKinds


def new(rid: str, prompt: int, computed: int = 0):
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(range(prompt)), prompt_embeds=None,
                           num_computed_tokens=computed)


def output(new_reqs=(), cached=(), resumed=(), finished=()):
    """`cached`: (request id, tokens computed before this step)."""
    return SimpleNamespace(scheduled_new_reqs=list(new_reqs),
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                                                 num_computed_tokens=[c for _, c in cached],
                                                                 resumed_req_ids=set(resumed)),
                           finished_req_ids=set(finished))


def test_a_chunked_prompt_prefills_until_its_last_chunk_then_decodes():
    kinds = StepKinds()
    assert kinds.of(output([new("a", 100)])) == "prefill"  # tokens 0-39
    assert kinds.of(output(cached=[("a", 40)])) == "prefill"  # 40-79
    assert kinds.of(output(cached=[("a", 80)])) == "prefill"  # 80-99: its last chunk
    assert kinds.of(output(cached=[("a", 100)])) == "decode"
    assert kinds.of(output(cached=[("a", 101)])) == "decode"


def test_one_prefilling_request_makes_a_mixed_batch_prefill_wherever_it_sits():
    """Mutation seen to fail this: dropping a request from the watched ones when the first
    request of the batch is done (a `break` after the first computed prompt)."""
    kinds = StepKinds()
    assert kinds.of(output([new("a", 4), new("b", 50)])) == "prefill"
    for computed_b, kind in ((20, "prefill"), (50, "decode")):
        assert kinds.of(output(cached=[("a", 4 + computed_b // 20), ("b", computed_b)])) == kind
    assert kinds.of(output([new("c", 8)], cached=[("a", 7), ("b", 51)])) == "prefill"  # a new prompt
    assert kinds.of(output(cached=[("c", 8), ("a", 8), ("b", 52)])) == "decode"


def test_a_prefix_cached_prompt_prefills_its_rest_and_a_resumed_request_recomputes():
    kinds = StepKinds()
    assert kinds.of(output([new("a", 64, computed=63)])) == "prefill"  # the last token is computed
    assert kinds.of(output(cached=[("a", 64)])) == "decode"
    # preempted, then resumed: its prompt (and what it generated) is computed again, in chunks
    assert kinds.of(output(cached=[("a", 0)], resumed={"a"})) == "prefill"
    assert kinds.of(output(cached=[("a", 32)])) == "prefill"  # still inside its prompt
    assert kinds.of(output(cached=[("a", 64)])) == "decode"


def test_a_finished_request_is_forgotten():
    kinds = StepKinds()
    kinds.of(output([new("a", 10), new("b", 10)]))
    assert kinds.of(output(cached=[("b", 5)], finished={"a"})) == "prefill"
    assert "a" not in kinds._prompt_lens and "a" not in kinds._prefilling
    kinds.forget(output(finished={"b"}))
    assert kinds._prompt_lens == {} and kinds._prefilling == {}
