"""On-policy distillation's advantages (posttrain.algo.distill) against a float64 reference written
out per token, and the reverse-KL estimate's expectation against the exact reverse KL."""

import math

import pytest
import torch

from posttrain.algo.distill import DISTILL_MODES, distill_advantages
from posttrain.errors import ConfigError

STUDENT = [[-0.5, -1.0, -2.0], [-0.1, -3.0, 0.0]]
TEACHER = [[-0.7, -0.2, -2.5], [-1.1, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
TASK = [[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]]


def reference(mode: str, coef: float) -> list[list[float]]:
    """Per token: coef * (log q - log pi) (+ the task advantage in mixed mode), 0 off the mask."""
    out = []
    for s_row, t_row, m_row, a_row in zip(STUDENT, TEACHER, MASK, TASK):
        out.append([(coef * (t - s) + (a if mode == "mixed" else 0.0)) * m
                    for s, t, m, a in zip(s_row, t_row, m_row, a_row)])
    return out


@pytest.mark.parametrize("mode", ["reverse_kl", "mixed"])
def test_advantages_and_metrics_match_the_per_token_reference(mode):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    adv, metrics = distill_advantages(mode, t(STUDENT), t(TEACHER), t(MASK), coef=0.5, task_advantages=t(TASK))
    assert adv.flatten().tolist() == pytest.approx(sum(reference(mode, 0.5), []), abs=1e-12)
    tokens = [(s, q) for s_row, q_row, m_row in zip(STUDENT, TEACHER, MASK) for s, q, m in zip(s_row, q_row, m_row) if m]
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(s - q for s, q in tokens) / 5)
    assert metrics["distill/teacher_logprob"] == pytest.approx(sum(q for _, q in tokens) / 5)
    assert metrics["distill/student_logprob"] == pytest.approx(sum(s for s, _ in tokens) / 5)


def test_the_sampled_estimate_averages_to_the_exact_reverse_kl():
    """E_{y ~ pi}[log pi(y) - log q(y)] = KL(pi || q): the estimate the advantage is built on."""
    torch.manual_seed(0)
    log_pi = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    log_q = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    exact = sum(math.exp(p) * (p - q) for p, q in zip(log_pi.tolist(), log_q.tolist()))
    y = torch.multinomial(log_pi.exp(), 200_000, replacement=True)
    _, metrics = distill_advantages("reverse_kl", log_pi[y][None], log_q[y][None], torch.ones(1, len(y)))
    assert exact > 0.05 and metrics["distill/reverse_kl"] == pytest.approx(exact, rel=0.03)


def test_mixed_needs_task_advantages_and_unknown_modes_name_the_key():
    ones = torch.ones(1, 2)
    with pytest.raises(ValueError, match="task reward"):
        distill_advantages("mixed", ones, ones, ones)
    with pytest.raises(ConfigError, match="rl_config.distill_mode"):
        distill_advantages("forward_kl", ones, ones, ones)
    assert set(DISTILL_MODES.names()) >= {"reverse_kl", "mixed"}
