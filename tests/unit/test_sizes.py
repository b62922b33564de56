"""Size budgets of ``src/posttrain`` (the style anchors' R10, as tinygrad's CI caps its lines): a
module over 600 lines or a function over 80 fails; over 400 and 50 they warn, so a reviewer sees
what is growing. Lines are counted from the ``def`` (or its first decorator) to the function's end,
nested functions included; a module's lines are its physical lines."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "posttrain"
MODULE_WARN, MODULE_CAP = 400, 600
FUNCTION_WARN, FUNCTION_CAP = 50, 80


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.lineno, node.end_lineno - start + 1


def _sizes():
    modules, functions = {}, {}
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC.parent))
        text = path.read_text()
        modules[name] = len(text.splitlines())
        for func, line, size in _functions(ast.parse(text)):
            functions[f"{name}:{line} {func}"] = size
    return modules, functions


def test_modules_and_functions_stay_within_their_caps():
    modules, functions = _sizes()
    big = {m: n for m, n in modules.items() if n > MODULE_CAP}
    long = {f: n for f, n in functions.items() if n > FUNCTION_CAP}
    assert not big, f"modules over {MODULE_CAP} lines (split them): {big}"
    assert not long, f"functions over {FUNCTION_CAP} lines (split them): {long}"
    growing = [f"{m} ({n} lines)" for m, n in modules.items() if n > MODULE_WARN]
    growing += [f"{f} ({n} lines)" for f, n in functions.items() if n > FUNCTION_WARN]
    if growing:
        warnings.warn(f"over the size budget ({MODULE_WARN} lines a module, {FUNCTION_WARN} a function): "
                      + "; ".join(sorted(growing)), stacklevel=1)


def test_the_budget_check_counts_decorators_and_nested_functions():
    tree = ast.parse("@dec\ndef f():\n    def g():\n        return 1\n    return g\n")
    assert [(name, size) for name, _, size in _functions(tree)] == [("f", 5), ("g", 2)]
