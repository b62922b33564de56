"""On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes" (GKD); Lu & Thinking Machines 2025, "On-Policy Distillation"): a
frozen teacher scores the student's own samples token by token, and the student is trained toward
it by the policy gradient with a per-token advantage.

The reverse KL of the student pi to the teacher q over the student's samples is
``KL(pi || q) = E_{y ~ pi} [sum_t log pi(y_t | y_<t) - log q(y_t | y_<t)]``; its sampled-token
estimate at token t is ``k_t = log pi(y_t) - log q(y_t)``, and descending it with the score-function
gradient is the policy gradient with the per-token advantage ``-k_t`` (each token's own term: the
KL's future terms are dropped, as Tinker and TRL's on-policy GKD do). So

* ``reverse_kl`` (the default): ``A_t = coef * (log q(y_t) - log pi(y_t))``, the task reward unused;
* ``mixed``: ``A_t = A_task_t + coef * (log q(y_t) - log pi(y_t))``, the task reward's advantage
  (the run's estimator, e.g. GRPO's group norm) plus the distillation term.

``log pi`` is the log-prob of the sampled token under the policy that sampled it (the rollout's),
taken once before the update, so the advantage is a constant of the update and the loss's
importance ratio and clipping apply to it as to any advantage.

Pure math: tensors in, ``(advantages [B, T], metrics)`` out (DESIGN.md section 4).
"""

from __future__ import annotations

import torch

from posttrain.algo.masked import masked_mean
from posttrain.registry import Registry

DISTILL_MODES = Registry("distillation mode", key="rl_config.distill_mode")


def reverse_kl_estimate(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """``k_t = log pi(y_t) - log q(y_t)`` per token ``[B, T]``: the sampled-token estimate of the
    reverse KL ``KL(pi || q)`` (unbiased in expectation over ``y_t ~ pi``)."""
    return logprobs - teacher_logprobs


@DISTILL_MODES.register("reverse_kl")
def reverse_kl(logprobs, teacher_logprobs, response_mask, *, task_advantages=None, coef=1.0):
    """``A_t = -coef * k_t`` on response tokens (0 elsewhere); the task advantages are not used."""
    return -coef * reverse_kl_estimate(logprobs, teacher_logprobs) * response_mask


@DISTILL_MODES.register("mixed")
def mixed(logprobs, teacher_logprobs, response_mask, *, task_advantages=None, coef=1.0):
    """``A_t = A_task_t - coef * k_t`` on response tokens (0 elsewhere)."""
    if task_advantages is None:
        raise ValueError("distill_mode mixed needs the task reward's advantages")
    return (task_advantages - coef * reverse_kl_estimate(logprobs, teacher_logprobs)) * response_mask


def distill_advantages(mode: str, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       response_mask: torch.Tensor, *, coef: float = 1.0,
                       task_advantages: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token advantages ``[B, T]`` of distillation mode ``mode`` (:data:`DISTILL_MODES`)
    and its metrics: ``distill/reverse_kl`` (the mean over response tokens of ``k_t``),
    ``distill/teacher_logprob`` and ``distill/student_logprob`` (means of ``log q`` and ``log pi``
    over the same tokens)."""
    mask = response_mask.to(logprobs.dtype)
    advantages = DISTILL_MODES.get(mode)(logprobs, teacher_logprobs, mask, task_advantages=task_advantages,
                                         coef=coef)
    metrics = {"distill/reverse_kl": masked_mean(reverse_kl_estimate(logprobs, teacher_logprobs), mask).item(),
               "distill/teacher_logprob": masked_mean(teacher_logprobs, mask).item(),
               "distill/student_logprob": masked_mean(logprobs, mask).item()}
    return advantages, metrics
