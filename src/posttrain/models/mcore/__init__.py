"""Megatron-Core interop: the parameter mapping, the tensor/pipeline layouts and the converter."""
