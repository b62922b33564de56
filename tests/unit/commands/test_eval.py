"""Reliability probe, CLI (/work/shared/reviews/reliability_probe.md sections 1.4, 1.5): each bad
flag value is refused with exit 2 and a message naming the flag (or the file), never a traceback."""

from __future__ import annotations

import json

import pytest

from reliability_world import one_thread, world, write_config  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(argv, capsys):
    from posttrain.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


# ---- --debug after the subcommand ---------------------------------------------------------------------
def test_X5_debug_is_accepted_after_the_subcommand(capsys, tmp_path):
    from posttrain.cli import build_parser, main
    from posttrain.errors import ConfigError

    assert build_parser().parse_args(["train", "--config-name", "x", "--debug"]).debug is True
    assert build_parser().parse_args(["--debug", "train", "--config-name", "x"]).debug is True
    assert build_parser().parse_args(["train", "--config-name", "x"]).debug is False
    argv = ["plan", "--config-path", str(tmp_path), "--config-name", "nonexistent"]
    assert run_cli(argv, capsys)[0] == 2
    with pytest.raises(ConfigError, match="nonexistent"):  # --debug: the traceback, as documented
        main(argv + ["--debug"])


# ---- eval ---------------------------------------------------------------------------------------------
def test_X8_eval_truncated_safetensors_names_the_file(world, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(world / "model", model)
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    code, err = run_cli(["eval", "--model", str(model), "--data", str(world / "data" / "rl")], capsys)
    assert code == 2 and f"{model / 'model.safetensors'}: not a readable safetensors file" in err


@pytest.mark.parametrize("flags,flag", [(["--max-tokens", "0"], "--max-tokens 0"),
                                        (["--temperature", "-1"], "--temperature -1"),
                                        (["--temperature", "nan"], "--temperature nan"),
                                        (["--dtype", "int8"], "--dtype int8"),
                                        (["--verifier", "nosuch"], "--verifier nosuch"),
                                        (["--limit", "0"], "--limit 0"),  # X11
                                        (["--max-tokens", "1000000000"], "--max-tokens 1000000000")],  # X12
                         ids=["X10_max_tokens", "X10_temperature", "X10_temperature_nan", "X10_dtype",
                              "X10_verifier", "X11_limit_0", "X12_max_tokens_huge"])
def test_X10_X11_X12_eval_flags_are_named(world, capsys, flags, flag):
    code, err = run_cli(["eval", "--model", str(world / "model"), "--data", str(world / "data" / "rl"), *flags],
                        capsys)
    assert code == 2 and f"error: {flag}" in err
    assert "generate_config" not in err and "rl_config" not in err
    if "1000000000" in flag:
        assert "max_position_embeddings 256" in err


# ---- plan --hf-config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,why", [("{bad", "not valid JSON"),
                                      ('{"hidden_size": 8}', "missing key 'num_hidden_layers'"),
                                      ('{"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8}',
                                       "missing key 'num_attention_heads'"),
                                      ("[1, 2]", "JSON object"),
                                      ('{"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8, '
                                       '"num_attention_heads": 0}', "num_attention_heads must be a positive integer")],
                         ids=["malformed", "no_layers", "no_heads", "list", "zero_heads"])
def test_X15_plan_hf_config_names_the_file_and_key(world, tmp_path, capsys, text, why):
    hf = tmp_path / "hf.json"
    hf.write_text(text)
    code, err = run_cli(["plan", *write_config(world, tmp_path / "run"), "--hf-config", str(hf)], capsys)
    assert code == 2 and str(hf) in err and why in err


# ---- init-model ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,expect", [(["--vocab-size", "-1"], "--vocab-size -1: must be at least 259"),
                                          (["--vocab-size", "0"], "--vocab-size 0: must be at least 259"),
                                          (["--vocab-size", "5"], "--vocab-size 5: must be at least 259"),
                                          (["--tokenizer", "/nonexistent"],
                                           "--tokenizer /nonexistent: no such directory"),
                                          (["--tokenizer", "EMPTY"], "cannot load a tokenizer")],
                         ids=["X19_vocab_negative", "X20_vocab_0", "X20_vocab_5", "X19_tokenizer_missing",
                              "X19_tokenizer_empty_dir"])
def test_X19_X20_init_model_flags(tmp_path, capsys, flags, expect):
    (tmp_path / "empty").mkdir()
    flags = [str(tmp_path / "empty") if f == "EMPTY" else f for f in flags]
    code, err = run_cli(["init-model", "--output", str(tmp_path / "m"), *flags], capsys)
    assert code == 2 and expect in err and not (tmp_path / "m").exists()


# ---- score --------------------------------------------------------------------------------------------
def test_R15_score_non_utf8_input_names_file_and_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"response": "1", "label": "1"}\n{"response": "caf\xe9 1", "label": "1"}\n')
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src),
                         "--output", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and f"{src}:2: not valid UTF-8" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("parallel", ["0", "1"])
def test_R16_score_lone_surrogate_is_written(tmp_path, capsys, parallel):
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    src.write_text('{"response": "\\udc80 the answer is 1", "label": "1"}\n')
    code, _ = run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(out),
                       "--parallel", parallel], capsys)
    assert code == 0
    row = json.loads(out.read_text())
    assert row["response"] == "\udc80 the answer is 1" and row["scores"] == {"last_number": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.jsonl"]  # no .tmp left


@pytest.mark.parametrize("flags,expect", [(["--verifier", "nosuch"], "--verifier nosuch: unknown verifier"),
                                          (["--verifier-module", "no_such_module_xyz"],
                                           "--verifier-module no_such_module_xyz: cannot import"),
                                          (["--parallel", "-1"], "--parallel -1: must be >= 0"),
                                          (["--timeout", "0"], "--timeout 0.0: must be a finite number of seconds > 0"),
                                          (["--timeout", "-5"], "--timeout -5.0: must be"),
                                          (["--timeout", "nan"], "--timeout nan: must be")],
                         ids=["R18_verifier", "R18_module", "R19_parallel", "R19_timeout_0", "R19_timeout_neg",
                              "R20_timeout_nan"])
def test_R18_R19_R20_score_flags_are_named(tmp_path, capsys, flags, expect):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"response": "1", "label": "1"}) + "\n")
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src),
                         "--output", str(tmp_path / "o.jsonl"), *flags], capsys)
    assert code == 2 and expect in err and "rl_config" not in err


def test_R21_score_may_rewrite_its_input_in_place(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"response": "1", "label": "1"}) + "\n")
    assert run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(src),
                    "--parallel", "0"], capsys)[0] == 0
    assert json.loads(src.read_text())["scores"] == {"last_number": 1.0}
