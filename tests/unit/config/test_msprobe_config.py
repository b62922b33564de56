"""msprobe_config: its checks and the dump options the loop reads (posttrain.metrics.dumps)."""

from __future__ import annotations

import pytest

from posttrain.config.options import dump_options
from posttrain.config.run import load_run_config
from posttrain.errors import ConfigError

M = "msprobe_config."


def cfg(*overrides):
    return load_run_config("grpo_tiny_qwen2", overrides=list(overrides))


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"{M}msprobe=true", f"{M}step_start=3", f"{M}step_end=2"], "step_end=2 must be >= step_start=3"),
    ([f"{M}msprobe=true", f"{M}token_range_start=4", f"{M}token_range_end=1"],
     "token_range_end=1 must be >= token_range_start=4"),
    ([f"{M}msprobe=true", f"{M}dump_path="], "dump_path is empty"),
    ([f"{M}step_start=-1"], "step_start"),
])
def test_bad_msprobe_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*overrides)


def test_the_options_follow_the_keys():
    assert dump_options(cfg(f"{M}key_data_dump=true")) is None  # the switches count only with msprobe on
    o = dump_options(cfg(f"{M}msprobe=true", f"{M}key_data_dump=true", f"{M}reference_dump=true",
                         f"{M}configurations_dump=true", f"{M}dump_path=/tmp/d", f"{M}step_start=2", f"{M}step_end=3",
                         f"{M}token_range_end=5"))
    assert o.roles == {"key_data", "reference"} and o.configurations and o.dump_path == "/tmp/d"
    assert (o.token_start, o.token_end) == (0, 5)
    assert [i for i in range(1, 6) if o.dumps_step(i)] == [2, 3]
    every = dump_options(cfg(f"{M}msprobe=true"))  # step_start = step_end = 0: every iteration
    assert all(every.dumps_step(i) for i in (1, 7)) and every.roles == frozenset()
