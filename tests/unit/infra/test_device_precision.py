"""The precision a run gets on each device (posttrain.device.precision)."""

import pytest
import torch

from posttrain.device import precision
from posttrain.errors import ConfigError


def test_gpu_without_bf16_is_refused_by_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ConfigError, match="megatron_training.bf16: true.*no bf16 support"):
        precision("cuda", bf16=True, bf16_asked=True, rollout_dtype="float32", rollout_dtype_asked=True)
    with pytest.raises(ConfigError, match="generate_config.dtype: bfloat16"):
        precision("cuda:0", bf16=False, bf16_asked=False, rollout_dtype="bfloat16", rollout_dtype_asked=False)
    assert precision("cuda", bf16=False, bf16_asked=True, rollout_dtype="float32",
                     rollout_dtype_asked=True) == ("float32", "float32")


def test_gpu_with_bf16_keeps_the_configs_dtypes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert precision("cuda", bf16=True, bf16_asked=False, rollout_dtype="bfloat16",
                     rollout_dtype_asked=False) == ("bfloat16", "bfloat16")
