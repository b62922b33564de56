"""The verifier registry: lookup, unknown names, user modules, keyword filtering."""

import sys

import pytest

from posttrain.errors import ConfigError
from posttrain.reward import verifiers as reg

SEED_NAMES = ["base_acc", "acc", "strict_format", "format", "step", "math_17k_acc", "acc_for_ppo",
              "acc_for_dapo", "math_verify_reward"]


def test_seed_and_new_names_are_registered():
    known = reg.VERIFIERS.names()
    for name in SEED_NAMES + ["math_equiv", "answer_number", "last_number", "gsm8k"]:
        assert name in known


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        reg.VERIFIERS.get("acc_typo")
    assert "acc_typo" in str(e.value) and "math_equiv" in str(e.value) and "base_acc" in str(e.value)
    assert "rl_config.verifier_function" in str(e.value) and "rl_config.verifier_modules" in str(e.value)


def test_user_module_registers_a_verifier(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "from posttrain.reward.verifiers import register_verifier\n"
        "@register_verifier('my_exact')\n"
        "def my_exact(response, label):\n"
        "    return 1.0 if response.strip() == label.strip() else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg.import_verifier_modules(["my_rewards_mod"])
    spec = reg.VERIFIERS.get("my_exact")
    assert spec.accepts == frozenset()
    # keyword arguments the function does not take are not passed
    assert spec.call(" 17 ", "17", {"prompt": "p", "tool_call_num": 3}) == 1.0
    assert spec.call("16", "17", {}) == 0.0
    sys.modules.pop("my_rewards_mod", None)


def test_name_clash_is_an_error():
    @reg.register_verifier("clash_test")
    def one(response, label, **kw):
        return 1.0

    def two(response, label, **kw):
        return 2.0

    with pytest.raises(ConfigError, match="already registered"):
        reg.register_verifier("clash_test")(two)
    reg.register_verifier("clash_test", overwrite=True)(two)
    assert reg.VERIFIERS.get("clash_test").fn is two


def test_missing_module_is_a_config_error():
    with pytest.raises(ConfigError, match="verifier_modules"):
        reg.import_verifier_modules(["definitely_not_a_module_123"])
