"""Data: preprocessing (``preprocess``), chat templates (``templates``, ``encoding``), Megatron
indexed files (``indexed``), training datasets and the resumable sampler (``datasets``, ``sampler``).

Nothing is imported here, so ``import posttrain.data`` stays cheap; import the submodules.
"""
