"""The converter checked against Megatron-Core itself: `posttrain convert` output loaded (strictly)
into Megatron-Core 0.16's own GPTModel on 1 or 2 CPU processes gives the HF model's logits.

Tiny Qwen2 (q/k/v biases, untied) and tiny Llama (tied embeddings), converted at TP 1, TP 2 and
PP 2; logits within 1e-4 of Hugging Face's (fp32). PP 2 also runs the 1F1B schedule backward, with HF's loss.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.cli import main
from tests.megatron.mcore_harness import hf_reference_logits, mcore_logits

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_megatron_core_gives_the_hf_logits(tiny_hf, tmp_path, kind, tp, pp):
    hf = tiny_hf(kind)
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
                 "--save-dir", str(tmp_path / "mg"), "--target-tensor-parallel-size", str(tp),
                 "--target-pipeline-parallel-size", str(pp)]) == 0
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    out = mcore_logits(tmp_path / "mg", ids, tp=tp, pp=pp, backward=pp > 1)
    ref = hf_reference_logits(hf, ids)
    assert out["logits"].shape[-1] == 128 * tp  # 100 padded to 128 x TP
    torch.testing.assert_close(out["logits"][..., :100], ref, rtol=0, atol=1e-4)
    if pp > 1:  # the 1F1B schedule's forward and backward: HF's next-token loss, real gradients
        padded = torch.cat([ref, ref.new_zeros(*ref.shape[:2], 28)], dim=-1)  # Megatron's loss spans the padding
        hf_loss = torch.nn.functional.cross_entropy(padded[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
        assert float(out["loss"]) == pytest.approx(float(hf_loss), abs=1e-4)
        assert out["grad_norm"] > 0 and out["embedding_grad"].abs().sum() > 0
