"""posttrain.registry.Registry: registration, lookup errors, lazy "module:attr" targets, module loading."""

import subprocess
import sys

import pytest

from posttrain.errors import ConfigError
from posttrain.registry import Registry


def test_register_under_several_names_and_list_them_sorted():
    reg = Registry("widget")

    @reg.register("b", "a")
    def widget():
        return 1

    assert reg.add("c", 3) == 3
    assert reg.get("a") is widget and reg.get("b") is widget and reg.get("c") == 3
    assert reg.names() == ("a", "b", "c")
    assert "a" in reg and "z" not in reg


def test_duplicate_registration_raises():
    reg = Registry("widget")
    reg.add("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a")(lambda: 2)
    assert reg.get("a") == 1
    reg.add("a", 2, replace=True)
    assert reg.get("a") == 2


def test_unknown_name_lists_the_known_names():
    reg = Registry("advantage estimator", key="rl_config.adv_estimator", hint="See docs/algorithms.md.")
    for name in ("rloo", "gae", "group_norm"):
        reg.add(name, object())
    with pytest.raises(ConfigError) as err:
        reg.get("remax")
    assert str(err.value) == ("Unknown advantage estimator 'remax'; known: gae, group_norm, rloo. "
                              "Check rl_config.adv_estimator. See docs/algorithms.md.")
    with pytest.raises(ConfigError, match="^No advantage estimator given; known: gae"):
        reg.get("")
    with pytest.raises(ConfigError, match=r"^Unknown thing 'x'; known: \.$"):
        Registry("thing").get("x")


def test_lazy_target_is_imported_on_get(tmp_path, monkeypatch):
    (tmp_path / "reg_lazy_target_mod.py").write_text("class Engine:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("engine")
    reg.add("lazy", "reg_lazy_target_mod:Engine")
    assert "reg_lazy_target_mod" not in sys.modules  # registering imports nothing
    engine = reg.get("lazy")
    assert engine is sys.modules["reg_lazy_target_mod"].Engine
    assert reg.get("lazy") is engine
    sys.modules.pop("reg_lazy_target_mod", None)


def test_modules_are_imported_before_the_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "reg_plugin_mod.py").write_text(
        "from reg_shared_mod import REG\n"
        "REG.add('plugin', 42)\n")
    (tmp_path / "reg_shared_mod.py").write_text(
        "from posttrain.registry import Registry\n"
        "REG = Registry('plugin', modules=('reg_plugin_mod',))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from reg_shared_mod import REG

    assert "reg_plugin_mod" not in sys.modules
    assert REG.get("plugin") == 42 and REG.names() == ("plugin",)
    for mod in ("reg_plugin_mod", "reg_shared_mod"):
        sys.modules.pop(mod, None)


def test_import_is_cheap():
    code = "import sys, posttrain.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
