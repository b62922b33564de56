"""String normalisation of final answers before comparison (the seed's ``strip_string`` role).

Written for posttrain: it canonicalises the LaTeX spellings that differ only cosmetically
(``\\dfrac``/``\\frac``, ``\\left(``, ``$``, ``^\\circ``, ``\\text{cm}`` units, ``\\frac12``,
``a/b``, ``x = 5``, ``1,000``) so that plain string comparison catches most equal answers before
the symbolic comparison (math-verify) is tried.
"""

from __future__ import annotations

import re

_TEXT_UNIT_TAIL = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]*\}\s*$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_FRAC_DD = re.compile(r"\\frac(\d)(\d)")
_FRAC_D_BRACE = re.compile(r"\\frac(\d)\{")
_FRAC_BRACE_D = re.compile(r"\\frac\{([^{}]*)\}(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt(\w)")
_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

_REPLACEMENTS = (
    ("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
    ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""),
    ("\\%", ""), ("%", ""), ("\\displaystyle", ""),
)


def normalize_answer(s: str) -> str:
    """Canonical spelling of one final answer (see module docstring); linear in ``len(s)``."""
    s = s.strip()
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = _TEXT_UNIT_TAIL.sub("", s).strip() or s
    s = _TEXT_WRAP.sub(r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = s.replace(" ", "")
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _FRAC_DD.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_D_BRACE.sub(r"\\frac{\1}{", s)
    s = _FRAC_BRACE_D.sub(r"\\frac{\1}{\2}", s)
    s = _SLASH.sub(r"\\frac{\1}{\2}", s)
    s = _THOUSANDS.sub("", s)
    return s.rstrip(".")
