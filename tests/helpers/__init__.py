"""Helpers shared by the tests: plain functions, imported as ``tests.helpers.<module>``.

* :mod:`tests.helpers.data`: the addition prompts ("What is a + b?") and letter pairs, preprocessed
  with the real pipeline;
* :mod:`tests.helpers.configs`: the one builder of run configs for the loop tests;
* :mod:`tests.helpers.runs`: ``posttrain`` in process (``run_cli``), metrics files, and the mini
  world's GRPO run (the ``mini_world`` and ``base_run`` fixtures of tests/conftest.py);
* :mod:`tests.helpers.verifiers`: verifiers that reward workers import by name.

Fixtures (tiny models, datasets, reference runs) live in tests/conftest.py.
"""
