"""Multimodal GRPO (``rl_config.is_multimodal``) on 2 Ray actor workers (DDP) against the same run in
one process: the tiny Qwen2.5-VL of ``posttrain init-model``, 4 prompts x 2 samples, one 56x56 image
each (4 image tokens).

Each sample's images travel with its rows: to the workers' native engines (``generate(images=)``),
into the reference and old log-prob passes and into the update (the vision tower trained through
DDP), with the rows shared by tokens (``use_dp_batch_balance``). The workers draw the same responses;
the image embeddings they compute on their shares of the samples (``reuse_image_embeds``'s phase)
and the log-probs read with them equal the one-process ones; two iterations log the same metrics
and leave the same weights (the tower's too) as in one process; rank 0 saves the processor with
the weights.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from tests.cluster.cluster_helpers import column, sample, session_and_trainer
from tests.cluster.test_ray_grpo import is_wall_clock, same
from tests.helpers.configs import OMIT, VERIFIERS, run_config

pytestmark = pytest.mark.ray
COLOURS = ["red", "blue", "green", "black"]


@pytest.fixture(scope="module")
def mm_data(tiny_vlm_dir, tmp_path_factory):
    """4 prompts "<image> colour?", each with a 56x56 picture of one coloured square."""
    from posttrain.data.preprocess import preprocess
    from tests.helpers.data import write_jsonl

    root = tmp_path_factory.mktemp("ray_mm")
    rows = []
    for i, colour in enumerate(COLOURS):
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).rectangle((8 + 4 * i, 8, 40, 40), fill=colour)
        image.save(root / f"{i}.png")
        rows.append({"problem": "<image> colour?", "answer": colour, "images": [f"{i}.png"]})
    write_jsonl(root / "in.jsonl", rows)
    preprocess({"input": str(root / "in.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(tiny_vlm_dir), "prompt_type": "qwen2_vl",
                "output_prefix": str(root / "data" / "mm"), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"], "workers": 1}, progress=False)
    return str(root / "data" / "mm")


def mm_config(model_dir, data, out, *, workers: int, iters: int, rl: dict):
    """4 prompts x 2 samples an iteration (2 optimizer steps of 4 rows), 6 new tokens, the lowercase
    reward (the reward workers import its module), KL in the loss,
    a checkpoint at the last iteration, on ``workers`` Ray actor workers (1: in process)."""
    return run_config(model_dir, data, out / "run", name=out.name, iters=iters, megatron_training={
        "global_batch_size": 4, "micro_batch_size": 2, "seq_length": 256, "lr": 1e-3, "seed": 5, "bf16": OMIT,
        "prompt_type": "qwen2_vl", "save": str(out / "ckpt"), "save_interval": iters}, rl_config={
        "n_samples_per_prompt": 2, "verifier_function": ["e2e_lowercase"], "verifier_modules": [VERIFIERS],
        "verifier_parallel": 0, "init_kl_coef": 0.01, "max_prompt_length": 160, "kl_penalty": "low_var_kl",
        "device": OMIT, "is_multimodal": True, "mini_batch_size": 2, "actor_resource": {"num_devices": workers},
        "ray_timeout_s": 120, "use_dp_batch_balance": True, **rl}, generate_config={
        "max_num_seqs": 16, "limit_mm_image_per_prompt": 1, "max_model_len": 256,
        "sampling_config": {"max_tokens": 6, "temperature": 1.0, "top_k": -1}}, actor_config={})


def initial_weights(path) -> dict[str, torch.Tensor]:
    """The weights of a saved VLM directory, as Transformers' loader names them (the model's own names)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path)).state_dict()


def reused_embeds_pass(trainer) -> "TransferDock":  # noqa: F821
    """A batch of samples (the rollout with each prompt's images) in a dock with the ``image_embeds``
    column, the embeddings computed by the actor's tower (2 samples a read, 1 image a tower forward;
    on Ray each worker its share) and the old log-probs read with them."""
    from posttrain.loops.experience import new_dock
    from posttrain.loops.multimodal import EMBEDS_COLUMN, compute_image_embeds, dock_columns, image_embedder

    td = new_dock(trainer.plan.rows_per_update, trainer.plan.n, guarantee_order=True, seed=0,
                  extra_columns=dock_columns(True), extra_consumers=(EMBEDS_COLUMN,))
    sample(trainer, td)
    compute_image_embeds(td, image_embedder(trainer.s.policy, trainer.s.device, 1), 2)
    trainer.logprobs(td, "old_logprobs", trainer.s.policy.actor, trainer.plan.reads["actor_logprob_dispatch_size"],
                     None)
    return td


def test_two_workers_equal_one_process(ray_cluster, tiny_vlm_dir, mm_data, tmp_path):
    """The same rollout, reused image embeddings and log-probs read with them; then 2 iterations
    with the tower trained: the same metrics and weights (the tower's too), and rank 0 saves the
    processor with the weights."""
    sessions = {where: session_and_trainer(mm_config(tiny_vlm_dir, mm_data, tmp_path / where, workers=workers,
                                                     iters=2, rl={"vit_forward_micro_batch_size": 1}))
                for where, workers in (("local", 1), ("ray", 2))}
    (local, local_trainer), (remote, remote_trainer) = sessions["local"], sessions["ray"]
    try:
        assert remote.policy.model is None and remote.cluster.world == 2 and local.cluster is None
        pad = remote.policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")  # the driver's processor
        assert remote.policy.image_token_id == local.policy.image_token_id == pad
        docks = {where: reused_embeds_pass(trainer) for where, (_, trainer) in sessions.items()}
        assert torch.equal(column(docks["ray"], "responses"), column(docks["local"], "responses"))
        assert column(docks["local"], "image_embeds").numel() == 8 * 4 * 128  # 8 samples x 4 image tokens x H
        for name in ("image_embeds", "old_logprobs"):
            torch.testing.assert_close(column(docks["ray"], name), column(docks["local"], name), rtol=1e-5, atol=1e-5)
        rows = {where: [trainer.train_step(iteration) for iteration in (1, 2)]
                for where, (_, trainer) in sessions.items()}
        for want, got in zip(rows["local"], rows["ray"]):
            assert sorted(got) == sorted(want)
            compared = [k for k in want if not is_wall_clock(k)]
            for key in compared:
                assert same(got[key], want[key], key), (key, got[key], want[key])
            assert want["actor/grad_norm"] > 0 and want["actor/kl_loss"] > 0 and len(compared) > 15
        before, local_weights = initial_weights(tiny_vlm_dir), local.policy.model.state_dict()
        for ray_weights in remote.cluster.state_dicts():
            for key, value in local_weights.items():
                torch.testing.assert_close(ray_weights[key], value, rtol=1e-4, atol=1e-5, msg=key)
        changed = {k for k in before if not torch.equal(before[k], local_weights[k])}
        assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
        path = remote.save(2, {})
        assert (path / "preprocessor_config.json").is_file() and (path / "model.safetensors").is_file()
    finally:
        for session, trainer in sessions.values():
            if trainer.source is not None:
                trainer.source.close()
            session.close()
