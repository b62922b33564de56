"""posttrain: reinforcement-learning post-training of language models on any hardware.

Importing the package is cheap: it does not import torch, ray or vllm. Subpackages import
what they need when they are used.
"""

__version__ = "0.1.0"

from posttrain.errors import PosttrainError  # noqa: E402  (lightweight)

__all__ = ["PosttrainError", "__version__"]
