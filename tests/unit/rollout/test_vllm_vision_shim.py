"""The torchvision-free stand-in for Transformers' Qwen2-VL image-processor module
(tests.helpers.vllm_vision_shim): the same smart_resize code, installed only without torchvision."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys

import pytest

from tests.helpers import vllm_vision_shim as shim


def _function_tree(source: str, name: str) -> str:
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return ast.dump(node)


def test_the_pil_smart_resize_is_the_torchvision_modules_code():
    """The torchvision module cannot be imported here, so its file is parsed: the two functions'
    syntax trees (docstrings aside) are equal, so the stand-in computes what vLLM imported before."""
    origin = importlib.util.find_spec(shim.TORCHVISION_MODULE).origin
    with open(origin, encoding="utf-8") as file:
        torchvision_tree = _function_tree(file.read(), "smart_resize")
    pil = importlib.import_module(shim.PIL_MODULE)
    assert _function_tree(inspect.getsource(pil), "smart_resize") == torchvision_tree


@pytest.fixture
def no_module(monkeypatch):
    """The torchvision module's name absent from sys.modules, and put back as it was afterwards."""
    monkeypatch.setitem(sys.modules, shim.TORCHVISION_MODULE, None)
    del sys.modules[shim.TORCHVISION_MODULE]


def test_install_without_torchvision_registers_the_pil_functions(no_module, monkeypatch):
    monkeypatch.setattr(shim, "torchvision_missing", lambda: True)
    assert shim.install()
    stand_in = sys.modules[shim.TORCHVISION_MODULE]
    pil = importlib.import_module(shim.PIL_MODULE)
    assert stand_in.smart_resize is pil.smart_resize
    assert stand_in.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # what vLLM imports

    assert smart_resize(100, 60, factor=28, min_pixels=56 * 56, max_pixels=256 * 256) == (112, 56)
    assert not shim.install(), "a second install must leave the registered module alone"


def test_install_is_a_no_op_with_torchvision(no_module, monkeypatch):
    monkeypatch.setattr(shim, "torchvision_missing", lambda: False)
    assert not shim.install()
    assert shim.TORCHVISION_MODULE not in sys.modules
