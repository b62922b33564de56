"""posttrain: reinforcement-learning post-training of language models on any hardware.

Importing the package is cheap: it does not import torch, ray or vllm. Subpackages import
what they need when they are used.
"""

from posttrain.version import __version__  # noqa: E402

from posttrain.errors import PosttrainError  # noqa: E402  (lightweight)

__all__ = ["PosttrainError", "RunSummary", "__version__", "evaluate", "init_model", "plan", "register_reward", "train"]

# the Python API (posttrain.api), imported on first use so that `import posttrain` stays cheap
_API = ("train", "plan", "evaluate", "register_reward", "init_model", "RunSummary")


def __getattr__(name: str):
    if name in _API:
        from posttrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
