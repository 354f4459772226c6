"""Which vLLM requests the runner can serve: greedy decoding of token-id prompts.

The replica samples greedily inside its step (`Model.sample`), so anything that changes the
greedy choice (temperature, penalties, biases, masks, grammars) or asks for more than the
chosen ids (log-probabilities) would silently give a different answer than vLLM's own worker.
Such a request is refused when it first reaches the worker, naming the request and the field.
"""

from __future__ import annotations

from typing import Any

from runner_fsm.integrations.vllm.errors import UnsupportedRequestError

SAMPLING_EPS = 1e-5  # vLLM's threshold under which a temperature means greedy

# field -> value that leaves greedy decoding unchanged
_NEUTRAL = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# fields that must be empty (None, empty, False or 0)
_UNSET = ("logit_bias", "allowed_token_ids", "bad_words", "logprobs", "prompt_logprobs",
          "structured_outputs", "logprob_token_ids", "thinking_token_budget",
          "repetition_detection", "watermarking", "trace_decode_token_ids")


def check_request(new_req: Any) -> None:
    """Raise `UnsupportedRequestError` unless `new_req` (vLLM's NewRequestData) is plain greedy."""
    rid = new_req.req_id

    def refuse(what: str) -> None:
        raise UnsupportedRequestError(
            f"request {rid!r}: FSMWorker serves greedy decoding of token-id prompts only; {what}."
            f" Use temperature=0 and no penalties, biases, logprobs or structured outputs,"
            f" or drop worker_cls to serve it with vLLM's own worker")

    if getattr(new_req, "pooling_params", None) is not None:
        refuse("it is a pooling request")
    if getattr(new_req, "lora_request", None) is not None:
        refuse("it uses a LoRA adapter")
    if getattr(new_req, "prompt_embeds", None) is not None:
        refuse("its prompt is given as embeddings")
    if getattr(new_req, "mm_features", None):
        refuse("it carries multimodal inputs")
    if new_req.prompt_token_ids is None:
        refuse("it has no prompt token ids")
    params = new_req.sampling_params
    if params is None:
        refuse("it has no sampling parameters")
    if params.temperature >= SAMPLING_EPS:
        refuse(f"temperature={params.temperature} samples at random")
    for name, neutral in _NEUTRAL.items():
        value = getattr(params, name, neutral)
        if value != neutral:
            refuse(f"{name}={value} changes the greedy choice")
    for name in _UNSET:
        value = getattr(params, name, None)
        if value:
            refuse(f"{name}={value!r} is set")
    if getattr(params, "min_tokens", 0) > 0 and not (params.ignore_eos and not params.stop_token_ids):
        refuse(f"min_tokens={params.min_tokens} masks stop tokens, which the greedy sampler cannot")
