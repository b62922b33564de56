"""Shared fixtures: a tiny tokenizer and tiny random-init models built locally (no downloads), the
addition-prompt datasets, and the mini world's reference run. Helper functions are in tests/helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.data import addition, addition_rows, preprocess_prompts
from tests.helpers.runs import world_run_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pin torch's threads (posttrain otherwise lowers them to the cores free at a run's start, which
# depends on the machine's load): every run of the suite reduces in the same order
if "OMP_NUM_THREADS" not in os.environ:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())

# the fp32 linear kernel (posttrain.models.cpu_linear) pinned too: "auto" times it on the machine;
# tests/unit/models/test_cpu_linear.py checks the oneDNN kernel itself
os.environ.setdefault("POSTTRAIN_CPU_LINEAR", "blas")
# and the rollout's prepacked weights (posttrain.models.packed_linear; tests/unit/rollout/test_packed.py checks them)
os.environ.setdefault("POSTTRAIN_ROLLOUT_PACKED", "off")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def fp32_cpu():
    """Every test sees a CPU without bf16 matmul units, so a run's precision (bf16 by default where
    the CPU has AMX or AVX512-BF16) and its numbers are the same on every CI machine. Session-wide,
    so that module- and session-scoped fixtures' runs see it too; tests of the choice itself patch
    ``cpu_supports_bf16`` with their own ``monkeypatch``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("posttrain.device.cpu_supports_bf16", lambda: False)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 (hidden 384, 6 layers) with a local BPE tokenizer and chat template."""
    from posttrain.commands.init_model import init_model

    out = tmp_path_factory.mktemp("models") / "tiny_qwen2"
    return init_model("tiny_qwen2", out, seed=1234)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2.5-VL (text 2 layers, hidden 128; vision depth 2, hidden 64), with the
    vision tokens in its tokenizer and a saved image processor (``posttrain init-model``)."""
    from posttrain.commands.init_model import init_model

    return init_model("tiny_qwen25_vl", tmp_path_factory.mktemp("models") / "tiny_qwen25_vl", seed=1234)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3-VL (text 2 layers, hidden 128, query/key norms; vision depth 2, hidden 64,
    patch 16, deepstack on block 0), with its tokenizer and image processor (``posttrain init-model``)."""
    from posttrain.commands.init_model import init_model

    return init_model("tiny_qwen3_vl", tmp_path_factory.mktemp("models") / "tiny_qwen3_vl", seed=1234)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def write_sum_prompts(root: Path, tokenizer_dir: Path) -> str:
    """16 "What is a + b?" prompts (a, b < 4) with their answers as labels, preprocessed with the
    tokenizer in ``tokenizer_dir`` into ``root/rl/data``; returns that prefix."""
    rows = [addition(a, b) for a in range(4) for b in range(4)]
    return preprocess_prompts(rows, root / "rl.jsonl", tokenizer_dir, root / "rl" / "data", prompt_type="default")


@pytest.fixture(scope="session")
def sum_prompts():
    """:func:`write_sum_prompts`, for tests that preprocess the sums with their own tokenizer."""
    return write_sum_prompts


@pytest.fixture(scope="session")
def tiny_prompt_data(tmp_path_factory, tiny_model_dir) -> str:
    """Prefix of an RL prompt dataset (input_ids + labels) for the tiny tokenizer: 64 random additions
    (seed 0), the ``default`` prompt."""
    root = tmp_path_factory.mktemp("tiny_data")
    return preprocess_prompts(addition_rows(64, 0), root / "rl.jsonl", tiny_model_dir, root / "rl" / "data",
                              prompt_type="default")


@pytest.fixture(scope="session")
def mini_qwen2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A 2-layer Qwen2 (hidden 64, seed 0) saved with the tiny tokenizer: fast enough for loops
    that must learn within a few iterations in a test (tests/e2e, tests/cluster). Read-only: copy it
    before training into it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("models") / "mini_qwen2"
    tok = tiny_tokenizer
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_lowercase_reward_model(out: Path, tokenizer) -> Path:
    """A 1-layer Qwen2 reward model (sequence classification) whose score grows with the share of
    lowercase-word tokens (``a``, ``the``, ``ink``, ...) in prompt + response, by construction:

    * every embedding holds a constant K = 10 in dimension 2 (so each token's RMS norm is about
      K / 8), and the lowercase-word tokens hold 1 in dimension 0;
    * queries and keys are 0, so attention averages the values of all positions so far; the value
      reads dimension 0 and the output projection writes 10 x that average into dimension 1;
    * the MLP adds nothing, and the score head reads dimension 1 after the final RMS norm:
      ``score = 8 x 10 x m / sqrt(K^2 + (10 m)^2 + ...)`` with m = 0.8 x the lowercase share, which rises
      with the share (0 for none, about 3 for a half).
    """
    import re

    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    vocab = len(tokenizer)
    lowercase = [i for i in range(vocab) if re.fullmatch(r"[a-z]+", tokenizer.decode([i]).strip())]
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 0.01)
        emb[:, 2] = 10.0
        emb[:, 0] = 0.0
        emb[lowercase, 0] = 1.0
        layer = model.model.layers[0]
        layer.self_attn.v_proj.weight[0, 0] = 1.0  # key-value head 0, dimension 0 <- dimension 0
        layer.self_attn.o_proj.weight[1, 0] = 10.0  # residual dimension 1 <- attention head 0, dimension 0
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        model.score.weight[0, 1] = 1.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lowercase_rm_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """:func:`build_lowercase_reward_model` on the tiny tokenizer (read-only)."""
    return build_lowercase_reward_model(tmp_path_factory.mktemp("models") / "lowercase_rm", tiny_tokenizer)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module (restored after it): tiny matmuls thrash with 2 threads on a
    loaded 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def mini_world(tmp_path_factory, mini_qwen2_dir) -> Path:
    """A copy of the mini Qwen2 (``model``) and 32 random additions (seed 0, the ``trl`` prompt) in
    ``data/rl`` (read-only). :func:`tests.helpers.runs.world_run_dict` is a GRPO run on it."""
    import shutil

    root = tmp_path_factory.mktemp("mini_world")
    shutil.copytree(mini_qwen2_dir, root / "model")
    preprocess_prompts(addition_rows(32, 0), root / "rl.jsonl", root / "model", root / "data" / "rl",
                       prompt_type="trl", workers=1)
    return root


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, mini_world, one_thread) -> Path:
    """2 iterations of the mini world's GRPO run with a save at each (``ckpt``: iter_0000001,
    iter_0000002, tracker 2; ``out/metrics.jsonl``), once per module, for the tests that damage or
    reuse a checkpoint (on a copy: :func:`tests.helpers.runs.copy_run`)."""
    from posttrain.commands.train import train_config as train

    run = tmp_path_factory.mktemp("base")
    train(world_run_config(mini_world, run, iters=2))
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return run


# Tiny HF models of every architecture `posttrain convert` handles (hidden 64, 4 heads in 2 query
# groups, FFN 128, 4 layers, vocab 100 so that Megatron's padding to 128 x TP adds rows).
TINY_ARCHS = {
    "qwen2": dict(cls="Qwen2ForCausalLM", tie_word_embeddings=False),                # q/k/v biases
    "llama": dict(cls="LlamaForCausalLM", tie_word_embeddings=True),                 # SmolLM2-like, tied
    "qwen3": dict(cls="Qwen3ForCausalLM", tie_word_embeddings=False, head_dim=16),   # qk-norm
    "qwen2_rm": dict(cls="Qwen2ForSequenceClassification", tie_word_embeddings=False, num_labels=1),
    "qwen3_moe": dict(cls="Qwen3MoeForCausalLM", tie_word_embeddings=False, head_dim=16, num_experts=4,  # MoE:
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),  # top-2 of 4
}


def build_tiny_hf(out: Path, kind: str, seed: int = 0) -> Path:
    """Save a random tiny HF model of ``kind`` (see TINY_ARCHS) to ``out``; biases and norms are random too."""
    import torch
    import transformers

    spec = dict(TINY_ARCHS[kind])
    cls = getattr(transformers, spec.pop("cls"))
    config = cls.config_class(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              rms_norm_eps=1e-6, pad_token_id=0, **spec)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """``tiny_hf(kind)``: the path of a tiny HF model of ``kind``, built once per session (read-only)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_hf(root / kind, kind)
        return built[kind]

    return get


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def lowercase_judge_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny LLM judge SFT'd to reply "10" after a response that ends with a lowercase word and "0"
    otherwise (:func:`tests.helpers.judge.train_lowercase_judge`; read-only)."""
    from tests.helpers.judge import train_lowercase_judge

    return train_lowercase_judge(tmp_path_factory.mktemp("models") / "lowercase_judge", tiny_tokenizer)


@pytest.fixture(scope="session")
def pairwise_judge_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny pairwise LLM judge SFT'd to reply "B" when response B ends with a lowercase word, else
    "A" (:func:`tests.helpers.judge.train_pairwise_judge`; read-only)."""
    from tests.helpers.judge import train_pairwise_judge

    return train_pairwise_judge(tmp_path_factory.mktemp("models") / "pairwise_judge", tiny_tokenizer)
