"""Judge prompt templates: the text a judge reads for one response (or, pairwise, for two).

A template is plain text with the fields ``{prompt}``, ``{response}`` and ``{reference}`` (pairwise:
``{prompt}``, ``{response_a}``, ``{response_b}``, ``{reference}``); every other character, braces
included, is kept as written, so a template may ask for ``\\boxed{N}``. ``rl_config.judge_template``
is the template itself when it holds ``{response}``, else the path of a file that holds it.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import ConfigError

DEFAULT_TEMPLATE = (
    "Rate the response to the question from 0 (wrong or useless) to 10 (correct and complete).\n"
    "Question: {prompt}\n"
    "Reference answer: {reference}\n"
    "Response: {response}\n"
    "Reply with one line: Score: N, with N an integer from 0 to 10.\n"
)

PAIRWISE_TEMPLATE = (
    "Which response answers the question better?\n"
    "Question: {prompt}\n"
    "Reference answer: {reference}\n"
    "Response A: {response_a}\n"
    "Response B: {response_b}\n"
    "Reply with one line: Better: A, or Better: B.\n"
)


def load_template(spec: str | None, key: str = "rl_config.judge_template", needs: tuple[str, ...] = ("response",)) -> str:
    """The template of ``spec``: :data:`DEFAULT_TEMPLATE` for None, ``spec`` itself when it holds
    every field of ``needs``, else the text of the file ``spec`` names (which must hold them)."""
    if spec is None:
        return DEFAULT_TEMPLATE
    fields = [f"{{{name}}}" for name in needs]
    if all(f in spec for f in fields):
        return spec
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"{key}={spec!r}: neither a template (it lacks {', '.join(fields)}) nor an existing file; "
                          f"write the template inline with {', '.join(fields)}, or give the path of a file holding it")
    text = path.read_text(encoding="utf-8")
    missing = [f for f in fields if f not in text]
    if missing:
        raise ConfigError(f"{key}: the template file {path} lacks {', '.join(missing)}; the judge would not see "
                          f"the response it rates")
    return text


def fill(template: str, **fields: str) -> str:
    """``template`` with each ``{name}`` replaced by ``fields[name]`` (nothing else is interpreted)."""
    for name, value in fields.items():
        template = template.replace(f"{{{name}}}", value)
    return template
