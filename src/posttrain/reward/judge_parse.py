"""Reading a judge's verdict: a score ("Score: 7", ``\\boxed{7}``, or a regex of one's own) normalised
to [0, 1], and a pairwise choice ("Better: A").

A parser is a compiled regex with one capture group; the last match in the judge's text counts (a
judge that restates the format before answering is read by its final answer). A text without a
match, or whose number lies outside ``[0, max_score]``, is a parse failure: :func:`parse_score`
returns None and the caller gives it the configured failure value.
"""

from __future__ import annotations

import re

from posttrain.errors import ConfigError

NUMBER = r"([-+]?\d+(?:\.\d+)?)"
# rl_config.judge_parser names -> their regex
SCORE_PARSERS: dict[str, str] = {
    "score": r"(?i:score)\s*[:=]\s*\**\s*" + NUMBER,
    "boxed": r"\\boxed\{\s*" + NUMBER + r"\s*\}",
}
CHOICE = re.compile(r"Better\s*[:=]\s*\**\s*\(?([AB])\b")


def _one_group_regex(spec: str, key: str, what: str, example: str, names: str = "") -> re.Pattern:
    """``spec`` compiled, when it is a valid regex with exactly one capture group (around ``what``);
    ConfigError naming ``key`` otherwise (``names``: the parser names that could be given instead)."""
    instead = f"; or use one of {names}" if names else ""
    try:
        compiled = re.compile(spec)
    except re.error as err:
        raise ConfigError(f"{key}={spec!r}: not a valid regex ({err}); give one with a capture group around "
                          f"{what}, e.g. {example!r}{instead}") from err
    if compiled.groups != 1:
        raise ConfigError(f"{key}={spec!r}: the regex needs exactly one capture group around {what} (it has "
                          f"{compiled.groups}), e.g. {example!r}{instead}")
    return compiled


def compile_parser(spec: str, key: str = "rl_config.judge_parser") -> re.Pattern:
    """The regex of a parser name (:data:`SCORE_PARSERS`) or of a regex with exactly one capture
    group (the score); ConfigError naming ``key`` otherwise."""
    if spec in SCORE_PARSERS:
        return re.compile(SCORE_PARSERS[spec])
    return _one_group_regex(spec, key, "the score", r"Rating: (\d+)", ", ".join(SCORE_PARSERS))


def parse_score(text: str, parser: re.Pattern, max_score: float) -> float | None:
    """The last score ``parser`` finds in ``text`` divided by ``max_score`` (in [0, 1]); None when
    there is none, it is not a number, or it lies outside ``[0, max_score]``."""
    matches = parser.findall(text or "")
    if not matches:
        return None
    try:
        value = float(matches[-1])
    except ValueError:
        return None
    if not 0.0 <= value <= max_score:
        return None
    return value / max_score


def parse_choice(text: str, choice: re.Pattern = CHOICE) -> str | None:
    """``"A"`` or ``"B"``: the last match of ``choice`` (default: "Better: X") in a pairwise judge's
    text; None when there is none, or it is neither."""
    matches = [m.strip().upper() for m in choice.findall(text or "")]
    return matches[-1] if matches and matches[-1] in ("A", "B") else None


def compile_choice(spec: str | None, key: str = "--choice-parser") -> re.Pattern:
    """The regex (one capture group around A or B) of ``spec``; :data:`CHOICE` for None."""
    return CHOICE if spec is None else _one_group_regex(spec, key, "A or B", "Winner: ([AB])")
