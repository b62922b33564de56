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
