"""Verifiers for the algorithm end-to-end tests (imported by name in reward workers; not a test file)."""

from posttrain.reward.verifiers import register_verifier


@register_verifier("e2e_lowercase")
def lowercase_fraction(response: str, label: str, **kw) -> float:
    """Fraction of the response's characters that are ASCII lowercase letters (a graded, learnable reward)."""
    return sum("a" <= ch <= "z" for ch in response) / max(len(response), 1)


@register_verifier("e2e_has_lowercase")
def has_lowercase(response: str, label: str, **kw) -> float:
    """1.0 when at least half of the characters are ASCII lowercase letters, else 0.0 (a binary reward)."""
    return float(lowercase_fraction(response, label) >= 0.5)


@register_verifier("e2e_constant")
def constant(response: str, label: str, **kw) -> float:
    """Always 0.5: every group has zero score variance (dynamic sampling keeps nothing)."""
    return 0.5
