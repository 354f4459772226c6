"""The reference model against Hugging Face `transformers`' Mixtral on the same weights.

An outside implementation nobody here wrote: float32, tight tolerance, prefill through the
paged PCP path (P = 1, several requests in one batch) and greedy decode steps after it.
`transformers` is a test dependency (`pip install -e .[test]`): without it this file fails to
import, never skips.
"""

import numpy as np
import pytest
import torch
import transformers

from test_model_support import (
    Sequences, TargetDriver, make_model_dirs, open_target, prompt, runner_config,
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_model_dirs(tmp_path_factory.mktemp("hf"))


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].float().numpy()


def test_logits_match_transformers_mixtral(dirs):
    target_dir, _ = dirs
    hf = transformers.MixtralForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32)
    hf.eval()
    driver = TargetDriver(open_target(target_dir), runner_config())
    seqs = Sequences([prompt(9, 21), prompt(30, 22), prompt(2, 23)])
    checked = 0
    for step in range(4):
        b = seqs.prefill() if step == 0 else seqs.decode()
        result = driver.run(b, driver.agree_alone(b, step))
        start = 0
        for i, n in enumerate(b.num_scheduled):
            first = int(b.num_computed[i])
            tokens = seqs.tokens[i][: first + int(n)]
            expected = _hf_logits(hf, tokens)[first: first + int(n)]
            ours = result.logits[start: start + int(n)]
            np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=1e-4)
            assert ours.argmax(-1).tolist() == expected.argmax(-1).tolist()
            checked += int(n)
            start += int(n)
        seqs.advance(b, result.tokens)
    assert checked == 9 + 30 + 2 + 3 * 3
