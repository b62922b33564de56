"""KTO (``stage: dpo``, ``dpo_loss_type: kto``) end to end on the mini Qwen2 (2 layers, hidden 64), on CPU.

Unpaired rows on the DPO tests' prompts ("Repeat the letter w"), each with one random letter as its
completion, desirable when the letter is one of a-e and undesirable for f-j (a preference the
2-layer model can learn within a few steps, unlike copying the letter). Training raises the
desirable completions' log-probs above the reference's and lowers the undesirable ones' below it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.helpers.configs import OMIT, run_config
from tests.helpers.data import letter_pair, write_jsonl
from tests.helpers.runs import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def work(tmp_path_factory, mini_qwen2_dir):
    import shutil

    from posttrain.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("kto")
    shutil.copytree(mini_qwen2_dir, root / "model")
    rng = random.Random(0)
    rows = []
    for _ in range(96):
        pair = letter_pair(rng)
        rows.append({"prompt": pair["problem"], "completion": pair["rejected"], "label": pair["rejected"] < "f"})
    write_jsonl(root / "rows.jsonl", rows)
    preprocess(dict(input=str(root / "rows.jsonl"), handler_name="UnpairedPreferenceHandler",
                    output_prefix=str(root / "rows/data"), tokenizer_name_or_path=str(root / "model"),
                    prompt_type="trl", workers=1), progress=False)
    return root


def kto_config(work, iters: int, name: str, **keys):
    return run_config(work / "model", work / "rows/data", work / f"run_{name}", name=name, stage="dpo", iters=iters,
                      megatron_training={"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-2,
                                         "dataset_additional_keys": OMIT, "prompt_type": OMIT,
                                         "dpo_loss_type": "kto", "dpo_beta": 0.5, **keys})


def test_kto_raises_desirable_and_lowers_undesirable_log_probs(work, caplog):
    from posttrain.commands.train import train_config as train

    with caplog.at_level("WARNING", logger="posttrain.loops.kto"):
        train(kto_config(work, 8, "kto"))
    assert "KTO" not in caplog.text  # 53 desirable / 43 undesirable rows: 1.23, in the paper's [1, 4/3]
    rows = read_metrics(work / "run_kto")
    assert len(rows) == 8
    first = rows[0]  # the policy is the reference: r = 0 = z0, each row's loss 1 - sigma(0)
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-5) and first["kto/kl"] == pytest.approx(0, abs=1e-5)
    assert first["dpo/loss"] == pytest.approx(0.5, abs=1e-5) and "timing/reference_model" in first
    chosen, rejected = [r["rewards/chosen"] for r in rows], [r["rewards/rejected"] for r in rows]
    assert np.mean(chosen[-3:]) > 0.4 and np.mean(rejected[-3:]) < -0.3, (chosen, rejected)
    assert rows[-1]["dpo/loss"] < 0.75 * first["dpo/loss"]
    assert all(r["kto/kl"] >= 0 for r in rows) and max(r["kto/kl"] for r in rows) > 0.1  # z0 moves with the policy


def test_kto_warns_about_unbalanced_weights(work, caplog):
    from posttrain.commands.train import train_config as train

    with caplog.at_level("WARNING", logger="posttrain.loops.kto"):
        train(kto_config(work, 1, "kto_weights", kto_undesirable_weight=3.0))
    assert "1.0 x 53 / (3.0 x 43) = 0.411, outside the paper's advised range [1, 4/3]" in caplog.text


def _sequence_logps(model, prompt_ids, completion_ids) -> float:
    """log pi(completion | prompt), summed over the completion's tokens, by a plain HF forward."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    start = len(prompt_ids)
    return float(sum(logprobs[t - 1, int(ids[0, t])] for t in range(start, ids.shape[1])))


def test_first_step_matches_an_independent_computation(work):
    """With a reference that differs from the policy, the loop's first loss, rewards and z0 equal the
    paper's formula evaluated on log-probs from plain HF forwards of the first 16 rows (read in order)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.commands.train import train_config as train
    from posttrain.data.datasets import UnpairedPreferenceDataset

    policy = AutoModelForCausalLM.from_pretrained(work / "model", torch_dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(work / "model", torch_dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.save_pretrained(work / "ref")
    beta, lam_d, lam_u = 0.5, 1.2, 0.9
    train(kto_config(work, 1, "kto_exact", ref_model=str(work / "ref"), no_shuffle=True, kto_desirable_weight=lam_d,
                     kto_undesirable_weight=lam_u))
    got = read_metrics(work / "run_kto_exact")[0]

    ds = UnpairedPreferenceDataset(work / "rows/data")
    rows = []
    for i in range(16):
        it = ds[i]
        start = int(np.flatnonzero(it["labels"] != -100)[0])
        rows.append((it["input_ids"][:start], it["input_ids"][start:], bool(it["desirable"][0])))
    def ratio_of(x, y):
        return _sequence_logps(policy, x, y) - _sequence_logps(reference, x, y)

    ratio = [ratio_of(x, y) for x, y, _ in rows]
    mismatched = [ratio_of(rows[i][0], rows[i - 1][1]) for i in range(16)]  # row i's prompt, row i - 1's answer
    z0 = max(0.0, sum(mismatched) / 16)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    losses = [lam_d * (1 - sig(beta * (r - z0))) if d else lam_u * (1 - sig(beta * (z0 - r)))
              for r, (_, _, d) in zip(ratio, rows)]
    chosen = [beta * r for r, (_, _, d) in zip(ratio, rows) if d]
    rejected = [beta * r for r, (_, _, d) in zip(ratio, rows) if not d]
    assert z0 > 0.01 and chosen and rejected  # the reference point is active in this batch
    assert got["kto/kl"] == pytest.approx(z0, rel=1e-4, abs=1e-5)
    assert got["dpo/loss"] == pytest.approx(sum(losses) / 16, rel=1e-4)
    assert got["rewards/chosen"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-4, abs=1e-5)
    assert got["rewards/rejected"] == pytest.approx(sum(rejected) / len(rejected), rel=1e-4, abs=1e-5)


def test_kto_trains_a_lora_adapter_against_the_shared_backbone(work):
    """KTO with a LoRA adapter and the reference as the backbone with the adapter off: the zero-started
    adapter makes the policy the reference at the first step (each row's loss 1 - sigma(0)), then the
    desirable completions' rewards rise above the undesirable ones'."""
    from posttrain.commands.train import train_config as train

    lora = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 8,
            "lora_alpha": 16}
    cfg = run_config(work / "model", work / "rows/data", work / "run_kto_lora", name="kto_lora", stage="dpo", iters=12,
                     megatron_training={"global_batch_size": 16, "micro_batch_size": 8, "lr": 1e-1,
                                        "dataset_additional_keys": OMIT, "prompt_type": OMIT,
                                        "dpo_loss_type": "kto", "dpo_beta": 0.5},
                     actor_config=lora, rl_config={"share_backbone": True})
    train(cfg)
    rows = read_metrics(work / "run_kto_lora")
    assert rows[0]["dpo/loss"] == pytest.approx(0.5, abs=1e-5) and rows[0]["kto/kl"] == pytest.approx(0, abs=1e-5)
    chosen, rejected = [r["rewards/chosen"] for r in rows], [r["rewards/rejected"] for r in rows]
    # measured: the last three steps' rewards 0.19 (desirable) and -0.25 (undesirable), loss 0.45
    assert np.mean(chosen[-3:]) > np.mean(rejected[-3:]) + 0.3, (chosen, rejected)
    assert np.mean([r["dpo/loss"] for r in rows[-3:]]) < 0.47
