"""Token ids -> text for the reward stage (seed_system.md 5.1).

Responses: pad ids inside the response are treated as EOS (the seed replaces them before
decoding) and every special token is skipped, so a verifier sees only the generated text.
Labels: the ``labels`` column holds the ground-truth answer's token ids (padding and ``-100``
dropped) and decodes to the label text.
"""

from __future__ import annotations


def _rows(ids, lengths=None) -> list[list[int]]:
    """A list of int lists from a [B, T] tensor / array or a list of sequences, cut to lengths."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    rows = [list(r) if not isinstance(r, int) else [r] for r in ids]
    if lengths is not None:
        if hasattr(lengths, "tolist"):
            lengths = lengths.tolist()
        rows = [r[: int(n)] for r, n in zip(rows, lengths)]
    return rows


def decode_responses(tokenizer, response_ids, response_lengths=None) -> list[str]:
    """Decode response token ids to text, special tokens skipped.

    Args:
        tokenizer: an HF tokenizer.
        response_ids: [B, T] tensor/array or a list of id lists.
        response_lengths: optional [B] valid lengths (tokens after them are padding).
    """
    rows = _rows(response_ids, response_lengths)
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    if pad is not None and eos is not None and pad != eos:
        rows = [[eos if t == pad else t for t in r] for r in rows]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def decode_labels(tokenizer, label_ids, label_lengths=None) -> list[str]:
    """Decode the ``labels`` column (ground-truth answer token ids) to stripped text.

    Negative ids (``-100``) and padding are dropped; special tokens are skipped.
    """
    pad = tokenizer.pad_token_id
    rows = [[t for t in r if t >= 0 and t != pad] for r in _rows(label_ids, label_lengths)]
    return [s.strip() for s in tokenizer.batch_decode(rows, skip_special_tokens=True)]
