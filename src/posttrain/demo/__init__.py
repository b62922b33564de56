"""The real-model demo: an arithmetic task that SmolLM2-135M-Instruct half-solves.

``tasks`` generates seeded chain-sum problems and writes JSONL splits, ``scoring`` extracts and
checks the final answer, ``evaluate`` measures greedy accuracy and group reward statistics with
plain Hugging Face ``generate``. Nothing here is imported by ``import posttrain``.
"""
