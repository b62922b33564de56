"""Value head model and reward-model scoring on a tiny random Qwen2."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

from posttrain.models.value_head import ValueHeadModel
from posttrain.reward.reward_model import RewardModelScorer


def _config():
    return Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                       max_position_embeddings=128)


class _Tok:
    """Just enough of a tokenizer for RewardModelScorer.score_sequences."""
    pad_token_id = 0
    eos_token_id = 1


@pytest.fixture(scope="module")
def vhm():
    torch.manual_seed(0)
    return ValueHeadModel.from_config(_config(), head_init="normal").eval()


def test_forward_shape_and_dtype(vhm):
    ids = torch.randint(2, 64, (3, 7))
    values = vhm(ids, torch.ones_like(ids))
    assert values.shape == (3, 7) and values.dtype == torch.float32
    assert values.std() > 0


def test_save_load_roundtrip_and_hf_compatibility(vhm, tmp_path):
    out = vhm.save_pretrained(tmp_path / "rm")
    ids = torch.randint(2, 64, (2, 6))
    mask = torch.ones_like(ids)
    again = ValueHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids, mask), vhm(ids, mask))
        # the directory is a plain HF sequence-classification model: same value at the last token
        hf = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
        torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).logits[:, 0], vhm(ids, mask)[:, -1])


def test_causal_lm_directory_gets_a_new_head(tmp_path):
    torch.manual_seed(1)
    lm = Qwen2ForCausalLM(_config())
    lm.save_pretrained(str(tmp_path / "lm"))
    critic = ValueHeadModel.from_pretrained(tmp_path / "lm", head_init="zero")
    assert torch.equal(critic.backbone.embed_tokens.weight, lm.model.embed_tokens.weight)
    ids = torch.randint(2, 64, (2, 5))
    assert torch.count_nonzero(critic(ids, torch.ones_like(ids))) == 0


def test_scores_are_read_at_the_last_response_token(vhm):
    scorer = RewardModelScorer(vhm, _Tok(), batch_size=2)
    prompts = [[5, 6, 7], [8, 9], [10]]
    responses = [[11, 12], [13, 14, 15, 16], [17]]
    got = scorer.score_sequences(prompts, responses)
    for p, r, g in zip(prompts, responses, got):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            want = vhm(ids, torch.ones_like(ids))[0, -1].item()
        assert g == pytest.approx(want, abs=1e-5)


def test_left_padding_gives_the_same_scores(vhm):
    scorer = RewardModelScorer(vhm, _Tok())
    seqs = [[5, 6, 7, 8], [9, 10]]
    right = scorer.score_sequences(seqs, [[], []])
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    left = scorer.score_padded(ids, mask)
    assert left.tolist() == pytest.approx(right, abs=1e-5)


def test_text_scoring_from_a_model_directory(tiny_model_dir):
    scorer = RewardModelScorer(str(tiny_model_dir))
    scores = scorer.score(["What is 2+2?", "Hi"], [" 4", " hello there"])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    assert scores[0] != scores[1]
