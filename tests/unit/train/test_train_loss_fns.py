"""The ready-made SFT, critic and DPO loss functions run through TrainEngine."""

import copy
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForTokenClassification

from posttrain.training.engine import TrainEngine
from posttrain.training.loss_fns import make_critic_loss_fn, make_dpo_loss_fn, make_sft_loss_fn, sequence_logps

from tests.unit.train.test_train_engine import make_batch, tiny_model


def test_sft_loss_decreases_and_is_token_mean_nll():
    model = tiny_model()
    batch = make_batch([3, 2], [4, 2])
    engine = TrainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), micro_batch_size=1)
    logprobs = engine.compute_logprobs(batch)
    expected = -(logprobs.sum() / batch["response_mask"].sum()).item()
    first = engine.update(batch, make_sft_loss_fn(), mini_batch_size=2)[0]["sft/loss"]
    assert first == pytest.approx(expected, rel=1e-5)
    for _ in range(5):
        last = engine.update(batch, make_sft_loss_fn(), mini_batch_size=2)[0]["sft/loss"]
    assert last < first - 0.1


def test_critic_loss_on_value_model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
        classifier_dropout=0.0,  # train-mode dropout would make the update differ from compute_values
    )
    critic = Qwen2ForTokenClassification(config)
    batch = make_batch([3, 2], [4, 2])
    engine = TrainEngine(critic, torch.optim.AdamW(critic.parameters(), lr=1e-2), metric_prefix="critic")
    values = engine.compute_values(batch)
    assert values.shape == (2, 4) and torch.all(values[1, 2:] == 0)
    batch["values"] = values
    batch["returns"] = values + 0.1 * batch["response_mask"]  # inside the clip range: no clipping
    metrics = engine.update(batch, make_critic_loss_fn(cliprange_value=0.5), mini_batch_size=2)[0]
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * 0.01, rel=1e-3)
    assert metrics["critic/vf_clipfrac"] == 0.0
    assert "critic/grad_norm" in metrics and "critic/lr" in metrics


def _dpo_batch(model):
    chosen, rejected = make_batch([3, 2], [4, 3], seed=5), make_batch([3, 2], [2, 4], seed=6)
    rejected["input_ids"][:, :5] = chosen["input_ids"][:, :5]  # same prompts
    rejected["attention_mask"][:, :5] = chosen["attention_mask"][:, :5]
    batch = {f"chosen_{k}": v for k, v in chosen.items()}
    batch.update({f"rejected_{k}": v for k, v in rejected.items()})
    with torch.no_grad():
        batch["ref_chosen_logps"], _ = sequence_logps(model, chosen)
        batch["ref_rejected_logps"], _ = sequence_logps(model, rejected)
    return batch


def test_dpo_starts_at_log2_and_improves_margin():
    model = tiny_model()
    batch = _dpo_batch(copy.deepcopy(model))
    engine = TrainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), micro_batch_size=1)
    first = engine.update(batch, make_dpo_loss_fn(beta=0.1), mini_batch_size=2)[0]
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # policy == reference
    for _ in range(3):
        last = engine.update(batch, make_dpo_loss_fn(beta=0.1), mini_batch_size=2)[0]
    assert last["rewards/margins"] > 0.05
    assert last["rewards/accuracies"] == 1.0


def test_dpo_loss_value_at_reference_is_log2():
    model = tiny_model()
    batch = _dpo_batch(model)
    loss, _ = make_dpo_loss_fn()(model, batch, num_tokens=None, num_seqs=2)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-5)


def test_the_loss_functions_declare_the_forward_a_backend_runs():
    """What the Megatron engine reads instead of running the loss's own forward."""
    from posttrain.training.loss_fns import PairLossFn, interleave_pairs, make_actor_loss_fn
    from posttrain.training.options import ActorLossOptions

    actor = make_actor_loss_fn(ActorLossOptions(temperature=0.7, entropy_coeff=0.01))
    assert (actor.consumes, actor.temperature, actor.with_entropy, actor.entropy_grad, actor.rows) == \
        ("logprobs", 0.7, True, True, None)
    assert (make_actor_loss_fn().with_entropy, make_actor_loss_fn().entropy_grad) == (True, False)
    assert make_actor_loss_fn(report_entropy=False).with_entropy is False
    assert make_critic_loss_fn().consumes == "values"
    sft = make_sft_loss_fn()
    assert (sft.consumes, sft.temperature, sft.with_entropy, sft.rows) == ("logprobs", 1.0, False, None)
    dpo = make_dpo_loss_fn(loss_type="ipo")
    assert isinstance(dpo, PairLossFn) and dpo.rows is interleave_pairs and dpo.average


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_on_rows_equals_dpo_on_pairs_and_both_report_the_loss(loss_type):
    """The row form a backend that takes rows runs (interleaved rows' log-probs, then
    after_forward with rows counted) gives the pair form's loss; with_loss_metric reports it in both."""
    from posttrain.training.forward import response_logprobs
    from posttrain.training.loss_fns import interleave_pairs, sequence_logps
    from posttrain.loops.dpo import with_loss_metric

    model = tiny_model()
    batch = _dpo_batch(copy.deepcopy(model))
    with torch.no_grad():  # the reference's log-probs as the loss type wants them, a little off the policy's
        for side in ("chosen", "rejected"):
            part = {k[len(side) + 1:]: v for k, v in batch.items() if k.startswith(side + "_")}
            batch[f"ref_{side}_logps"], _ = sequence_logps(model, part, average=loss_type == "ipo")
        batch["ref_chosen_logps"] -= 0.3
    loss_fn = with_loss_metric(make_dpo_loss_fn(beta=0.3, loss_type=loss_type, pref_ftx=0.2))
    with torch.no_grad():
        pairs, pair_metrics = loss_fn(model, batch, num_seqs=2)
        rows = interleave_pairs(batch)
        logprobs, _ = response_logprobs(model, rows)
        on_rows, row_metrics = loss_fn.after_forward(logprobs, None, rows, num_seqs=4)
    torch.testing.assert_close(on_rows, pairs)
    assert sorted(row_metrics) == sorted(pair_metrics) and "dpo/loss" in pair_metrics
    torch.testing.assert_close(pair_metrics["dpo/loss"], pairs)
