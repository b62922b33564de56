"""Warm imports for verifier workers: math-verify, sympy and the built-in verifiers.

Listed in the forkserver's preload (see :mod:`posttrain.reward.pool`), so every forked worker
starts with them imported; a worker started another way imports this module once at start.
Where math-verify is not installed (a GPU image that carries only the packages it needs), the
workers start without it, and only the verifiers that use it fail, with their own message.
"""

import importlib.util

import posttrain.reward.verifiers as _registry
from posttrain.reward.verifiers.equiv import _mv

_registry.VERIFIERS.names()
if importlib.util.find_spec("math_verify") is not None:
    _mv()
