"""Megatron-Core as a training backend (issue 17, in progress): the CPU shims it needs so far.

Nothing in the product builds a Megatron model yet; ``actor_config`` layouts with TP/PP > 1 are
still refused. docs/parallelism.md records what runs on a CPU with gloo and what does not.
"""
