"""profiler_config.integrated: the seed's checks, posttrain's refusals, and the options the loop reads."""

from __future__ import annotations

import pytest

from posttrain.config.options import profiler_options
from posttrain.config.run import load_run_config
from posttrain.errors import ConfigError

P = "profiler_config.integrated."


def cfg(*overrides):
    return load_run_config("grpo_tiny_qwen2", overrides=list(overrides))


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"{P}profile=true", f"{P}profile_export_type=db"], "db is the Ascend profiler's database format"),
    ([f"{P}profile=true", f"{P}stage=[actor_train]"], r"stage \['actor_train'\]: not a stage of the seed's profiler"),
    ([f"{P}profile=true", f"{P}profile_step_start=3", f"{P}profile_step_end=3"], "must be greater than"),
    ([f"{P}profile_level=level9"], "profiler_level only supports level0, 1, 2, and level_none"),
])
def test_bad_profiler_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*overrides)


def test_the_options_follow_the_keys():
    assert profiler_options(cfg(), "runs/x") is None
    options = profiler_options(cfg(f"{P}profile=true", f"{P}stage=[actor_update,critic_update]",
                                   f"{P}profile_ranks=[0,2]", f"{P}profile_level=level2"), "runs/x")
    assert options.stages == ("actor_update", "critic_update") and options.ranks == (0, 2)
    assert options.save_path == "runs/x/profile" and (options.start, options.end) == (1, 2) and options.level == "level2"
    marks = profiler_options(cfg(f"{P}mstx=true"), "runs/x")  # ranges only: no window, no trace
    assert marks.mstx and marks.start == marks.end
