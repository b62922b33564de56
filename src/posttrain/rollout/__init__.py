"""Rollout engines: the interface (base), the native PyTorch engine, the vLLM adapter."""
