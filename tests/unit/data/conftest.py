"""A tiny local BPE tokenizer with the Qwen chat tokens (no downloads)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> str:
    from posttrain.models.init_model import default_corpus, train_tokenizer

    out = tmp_path_factory.mktemp("data_tok")
    train_tokenizer(default_corpus(400), 300).save_pretrained(str(out))
    return str(out)
