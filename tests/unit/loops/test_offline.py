"""SFT and DPO batches train on the labelled tokens: the prompt is cut off, and unlabelled tokens
inside the response (user or tool turns of a conversation) are masked."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.errors import DataError
from posttrain.loops.offline import labelled_batch

IGN = -100


def test_unlabelled_tokens_inside_the_response_are_masked():
    ids = [np.array([1, 2, 3, 4, 5, 6, 7]), np.array([8, 9, 10])]
    labels = [np.array([IGN, IGN, 3, IGN, IGN, 6, 7]), np.array([IGN, 9, 10])]
    batch = labelled_batch(list(zip(ids, labels)), pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7], [0, 8, 9, 10, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]


def test_a_sample_without_labels_is_refused():
    with pytest.raises(DataError, match="no response tokens"):
        labelled_batch([(np.array([1, 2]), np.array([IGN, IGN]))], pad_token_id=0)
