"""Decoding response and label token ids for the verifiers."""

import torch

from posttrain.reward.decoding import decode_labels, decode_responses


def test_responses_skip_special_tokens_and_padding(tiny_tokenizer):
    tok = tiny_tokenizer
    text = "The answer is 17."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert pad is not None and eos is not None and pad != eos
    row = ids + [eos, pad, pad]
    batch = torch.tensor([row, ids[:3] + [pad] * (len(row) - 3)])
    out = decode_responses(tok, batch)
    assert out[0] == text
    assert out[1] == tok.decode(ids[:3])
    # with explicit lengths, the tail is cut before decoding
    assert decode_responses(tok, [row], response_lengths=[len(ids)]) == [text]


def test_labels_from_token_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok("42", add_special_tokens=False)["input_ids"]
    rows = [ids + [-100, tok.pad_token_id], [-100] + ids]
    assert decode_labels(tok, rows) == ["42", "42"]
