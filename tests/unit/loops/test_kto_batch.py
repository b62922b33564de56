"""The KTO loop's mismatched rows: each prompt with the previous row's completion (cyclic)."""

import numpy as np

from posttrain.loops.kto import mismatched_samples


def test_each_prompt_gets_the_previous_rows_completion():
    i = -100
    samples = [(np.array([1, 2, 10, 11]), np.array([i, i, 10, 11])),
               (np.array([3, 20]), np.array([i, 20])),
               (np.array([4, 5, 6, 30, 31, 32]), np.array([i, i, i, 30, 31, 32]))]
    out = mismatched_samples(samples)
    assert [ids.tolist() for ids, _ in out] == [[1, 2, 30, 31, 32], [3, 10, 11], [4, 5, 6, 20]]
    assert [labels.tolist() for _, labels in out] == [[i, i, 30, 31, 32], [i, 10, 11], [i, i, i, 20]]
