"""Multimodal GRPO on the megatron backend (Ray worker group, TP 2, gloo): the tiny Qwen2.5-VL of
``posttrain init-model`` (its language model as Megatron-Core's GPTModel, its HF tower frozen), the
colour prompts (3 with a 56x56 image, one text-only) x 2 samples, 2 iterations, a checkpoint each.

Each sample's images travel with its rows (the leader's native rollout on the full VLM, the log-prob
passes and the update on both TP ranks). The honest check, sample by sample: every sampled token's
rollout log-prob equals the Hugging Face forward, with the sample's own image, of the VLM that
sampled it (the vision tokens left out of the softmax, as the native engine never samples them),
and the trainer's old log-prob equals the same forward's (all tokens): iteration 1 against the
initial VLM, iteration 2 against it with the language model the workers hold after update 1
(gathered from the Megatron shards): so the leader's synced rollout copy and the chunks agree. The
metrics are finite; the checkpoint's ``iter_0000002/hf`` loads with ``AutoModelForImageTextToText``,
its language model's weights changed and its tower's did not. A run resumed from the straight run's
``iter_0000001`` (a kill after iteration 1: the GPTModel with mrope from the checkpoint's args, the
optimizer, LR schedule and trainer state from its files, the frozen VLM from its ``hf/``) takes
iteration 2 exactly as the straight run did (every metric but the wall-clock ones, and every saved
weight, equal: the text megatron resume tests' tolerance); ``finetune: true`` from that checkpoint is
refused (with what to load instead).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.e2e.test_e2e_multimodal_video import reference_logprobs
from tests.helpers.configs import OMIT, VERIFIERS, run_config
from tests.helpers.tiny_vlm import colour_prompts

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def megatron_mm_config(model_dir, data, out, *, load=None, finetune=False):
    """4 prompts x 2 samples an iteration (2 optimizer steps of 4 rows), 6 new tokens, KL in the loss,
    on the megatron backend at TP 2 (2 Ray workers), a checkpoint after each iteration."""
    return run_config(model_dir, data, out / "run", name=out.name, iters=2, megatron_training={
        "global_batch_size": 4, "micro_batch_size": 2, "seq_length": 256, "lr": 1e-2, "seed": 5, "bf16": OMIT,
        "prompt_type": "qwen2_vl", "save": str(out / "ckpt"), "save_interval": 1, "backend": "megatron",
        "tensor_model_parallel_size": 2}, rl_config={
        "n_samples_per_prompt": 2, "verifier_function": ["e2e_lowercase"], "verifier_modules": [VERIFIERS],
        "verifier_parallel": 0, "init_kl_coef": 0.01, "max_prompt_length": 160, "kl_penalty": "low_var_kl",
        "device": OMIT, "is_multimodal": True, "freeze_vision_tower": True, "mini_batch_size": 2, "actor_resource": {"num_devices": 2},
        "ray_timeout_s": 120, "guarantee_order": True}, generate_config={
        "max_num_seqs": 16, "limit_mm_image_per_prompt": 1, "max_model_len": 256,
        "sampling_config": {"max_tokens": 6, "temperature": 1.0, "top_k": -1}},
        actor_config={**({"load": str(load)} if load else {}), **({"finetune": True} if finetune else {})})


def test_grpo_with_images_on_the_megatron_backend(ray_cluster, tiny_vlm_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    from posttrain.commands.train import train_config as train
    from posttrain.errors import ConfigError
    from posttrain.loops.onpolicy import OnPolicyTrainer
    from posttrain.models.vlm import MM_KEYS
    from posttrain.rollout.images import vision_token_ids
    from posttrain.training.megatron.vlm_weights import hf_param_name
    from tests.helpers.runs import metrics_by_iteration

    (tmp_path / "data").mkdir()
    data = colour_prompts(tmp_path / "data", tiny_vlm_dir, text_only=(3,))
    samples, trained, real_correct = [], {}, OnPolicyTrainer.correct

    def correct(self, td, acc, iteration):  # the dock after the old log-prob pass
        if iteration == 2:  # the weights after update 1, gathered from the workers (HF names)
            trained.update(self.s.cluster.state_dicts()[0])
        samples.extend({"iteration": iteration, "prompt": td.cell("prompts", r), "response": td.cell("responses", r),
                        "rollout": td.cell("rollout_logprobs", r), "old": td.cell("old_logprobs", r),
                        "media": {k: td.cell(k, r) for k in MM_KEYS}} for r in range(td.max_len))
        return real_correct(self, td, acc, iteration)

    monkeypatch.setattr(OnPolicyTrainer, "correct", correct)
    out = tmp_path / "mg_mm"
    train(megatron_mm_config(tiny_vlm_dir, data, out))

    metrics = metrics_by_iteration(out / "run")
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["actor/grad_norm"] > 0
    load = lambda path: AutoModelForImageTextToText.from_pretrained(str(path)).eval()  # noqa: E731
    models = {1: load(tiny_vlm_dir), 2: load(tiny_vlm_dir), 3: load(out / "ckpt/iter_0000002/hf")}
    params = dict(models[2].named_parameters())
    with torch.no_grad():
        for name, tensor in trained.items():
            params[hf_param_name(name)].copy_(tensor)
    never = vision_token_ids(models[1])
    assert len(samples) == 16 and sum(int(s["media"]["image_grid_thw"].shape[0]) for s in samples) == 12
    for sample in samples:
        sample["media"]["image_grid_thw"] = sample["media"]["image_grid_thw"].long()
        model = models[sample["iteration"]]  # the weights that sampled it
        rollout, old = reference_logprobs(model, sample, never), reference_logprobs(model, sample)
        assert torch.allclose(sample["rollout"], rollout, atol=1e-4), (sample["rollout"] - rollout).abs().max()
        assert torch.allclose(sample["old"], old, atol=1e-4), (sample["old"] - old).abs().max()
    before, after = models[1].state_dict(), models[3].state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("language_model" in k for k in changed) and not any("visual" in k for k in changed), changed
    assert (out / "ckpt/iter_0000002/hf/preprocessor_config.json").is_file()

    assert_resumed_exactly(tmp_path, tiny_vlm_dir, data, out, monkeypatch)
    with pytest.raises(ConfigError, match="finetune: true"):  # its weights alone would start a new run: not built
        train(megatron_mm_config(tiny_vlm_dir, data, tmp_path / "tuned", load=out / "ckpt/iter_0000001",
                                 finetune=True))


def assert_resumed_exactly(tmp_path, model_dir, data, straight, monkeypatch):
    """The run resumed from ``straight``'s first checkpoint took its iteration 2: the same metrics (the
    wall clock aside) and the same saved weights (the trained VLM of ``iter_0000002/hf``, gathered from the
    Megatron shards)."""
    from safetensors.torch import load_file

    from posttrain.commands.train import train_config as train
    from tests.cluster.test_ray_grpo import is_wall_clock
    from tests.helpers.runs import metrics_by_iteration

    monkeypatch.undo()  # the straight run's recorder
    resumed = tmp_path / "resumed"
    train(megatron_mm_config(model_dir, data, resumed, load=straight / "ckpt/iter_0000001"))
    want, got = metrics_by_iteration(straight / "run"), metrics_by_iteration(resumed / "run")
    assert sorted(got) == [2]
    assert {k: v for k, v in got[2].items() if not is_wall_clock(k)} == \
        {k: v for k, v in want[2].items() if not is_wall_clock(k)}
    x, y = (load_file(str(run / "ckpt/iter_0000002/hf/model.safetensors")) for run in (straight, resumed))
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
