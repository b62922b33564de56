"""Warm imports for verifier workers: math-verify, sympy and the built-in verifiers.

Listed in the forkserver's preload (see :mod:`posttrain.reward.pool`), so every forked worker
starts with them imported; a worker started another way imports this module once at start.
"""

import posttrain.reward.verifiers as _registry
from posttrain.reward.verifiers.equiv import _mv

_registry.VERIFIERS.names()
_mv()
