"""Multimodal GRPO (``rl_config.is_multimodal``) on 2 Ray actor workers (DDP) against the same run in
one process: the tiny Qwen2.5-VL (tied embeddings) and Qwen3-VL (an untied LM head, a deepstack level)
of ``posttrain init-model``, 4 prompts x 2 samples, three with one 56x56 image each (4 image tokens)
and one text-only.

Each sample's images travel with its rows: to the workers' native engines (``generate(images=)``),
into the log-prob passes (rows shared by tokens, ``use_dp_batch_balance``) and into the update (the
vision tower trained through DDP, which must reduce it while one worker's step holds only the
text-only prompt's rows). The workers draw the same responses; the image embeddings they compute on
their shares of the samples (``reuse_image_embeds``'s phase) and the log-probs read with them equal
the one-process ones; two iterations log the same metrics and leave the same weights (the tower's
too) as in one process; rank 0 saves the processor with the weights.

Videos with partial and asynchronous rollout (tiny Qwen2.5-VL; prompts with a picture, a video, both,
and none): the rounds over the workers and their rollout copies sample with each prompt's media, a
cut sample continues with them, and 2 iterations give the one-process responses, old log-probs,
metrics and weights. Multimodal SFT on 2 workers: the one-process losses and weights. FSDP2
(``ray_sharding: fsdp2``) with a frozen tower, the tower whole on each worker: the one-process run.
"""

from __future__ import annotations

import pytest
import torch

from tests.cluster.cluster_helpers import column, sample, session_and_trainer
from tests.cluster.test_ray_grpo import is_wall_clock, same
from tests.helpers.configs import OMIT, VERIFIERS, run_config
from tests.helpers.tiny_vlm import colour_prompts

pytestmark = pytest.mark.ray
TEXT_ONLY = 3  # the prompt without an image


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm_dir(request):
    return request.getfixturevalue({"qwen2_5_vl": "tiny_vlm_dir", "qwen3_vl": "tiny_qwen3_vl_dir"}[request.param])


@pytest.fixture(scope="module")
def mm_data(vlm_dir, tmp_path_factory):
    """4 prompts "<image> colour?", each with a 56x56 picture of one coloured square (the last without)."""
    return colour_prompts(tmp_path_factory.mktemp("ray_mm"), vlm_dir, text_only=(TEXT_ONLY,))


def mm_config(model_dir, data, out, *, workers: int, iters: int, rl: dict, generate: dict | None = None):
    """4 prompts x 2 samples an iteration (2 optimizer steps of 4 rows), 6 new tokens, the lowercase
    reward (the reward workers import its module), KL in the loss,
    a checkpoint at the last iteration, on ``workers`` Ray actor workers (1: in process);
    ``generate``: more generate_config keys (its max_model_len is the seq_length too)."""
    return run_config(model_dir, data, out / "run", name=out.name, iters=iters, megatron_training={
        "global_batch_size": 4, "micro_batch_size": 2, "seq_length": (generate or {}).get("max_model_len", 256), "lr": 1e-3, "seed": 5, "bf16": OMIT,
        "prompt_type": "qwen2_vl", "save": str(out / "ckpt"), "save_interval": iters}, rl_config={
        "n_samples_per_prompt": 2, "verifier_function": ["e2e_lowercase"], "verifier_modules": [VERIFIERS],
        "verifier_parallel": 0, "init_kl_coef": 0.01, "max_prompt_length": 160, "kl_penalty": "low_var_kl",
        "device": OMIT, "is_multimodal": True, "mini_batch_size": 2, "actor_resource": {"num_devices": workers},
        "ray_timeout_s": 120, "guarantee_order": True, **rl}, generate_config={
        "max_num_seqs": 16, "limit_mm_image_per_prompt": 1, "max_model_len": 256,
        "sampling_config": {"max_tokens": 6, "temperature": 1.0, "top_k": -1}, **(generate or {})}, actor_config={})


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


def test_two_workers_equal_one_process(ray_cluster, vlm_dir, mm_data, tmp_path, monkeypatch):
    """The same rollout, reused image embeddings and log-probs read with them (rows shared by tokens);
    then 2 iterations with the tower trained, one worker's step on text-only rows alone: the same
    metrics and weights (the tower's too), and rank 0 saves the processor with the weights."""
    from posttrain.cluster import group
    from posttrain.training.multimodal import embeds_width

    sessions = {where: session_and_trainer(mm_config(vlm_dir, mm_data, tmp_path / where, workers=workers,
                                                     iters=2, rl={"vit_forward_micro_batch_size": 1}))
                for where, workers in (("local", 1), ("ray", 2))}
    (local, _), (remote, _) = sessions["local"], sessions["ray"]
    passes, slices = [], []  # the log-prob passes' shares; the images of each worker's update slice
    row_shares, update_shards, update = remote.cluster.row_shares, group.update_shards, remote.policy.actor.update

    def recording_shares(count, batch=None, collective=True):
        passes.append(row_shares(count, batch, collective))
        return passes[-1]

    def recording_update(batch, *args, **kwargs):
        images = [int(sample["image_grid_thw"].shape[0]) for sample in batch["images"].samples]

        def recording_shards(count, mini_batch_size, replicas, *rest):  # each replica's rows, step after step
            out = update_shards(count, mini_batch_size, replicas, *rest)
            step = mini_batch_size // replicas
            slices.extend([images[i] for i in rows[k:k + step].tolist()] for rows in out
                          for k in range(0, len(rows), step))
            return out

        monkeypatch.setattr(group, "update_shards", recording_shards)
        return update(batch, *args, **kwargs)

    monkeypatch.setattr(remote.cluster, "row_shares", recording_shares)
    monkeypatch.setattr(remote.policy.actor, "update", recording_update)
    try:
        assert remote.policy.model is None and remote.cluster.world == 2 and local.cluster is None
        pad = remote.policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")  # the driver's processor
        assert remote.policy.image_token_id == local.policy.image_token_id == pad
        remote.cluster.balance = True  # rl_config.use_dp_batch_balance for the passes before the update
        docks = {where: reused_embeds_pass(trainer) for where, (_, trainer) in sessions.items()}
        remote.cluster.balance = False  # contiguous update slices: rank 0's second step is the text-only prompt's
        assert any(share.tolist() != list(range(int(share[0]), int(share[0]) + len(share)))
                   for shares in passes for share in shares)  # the balance moved rows
        assert torch.equal(column(docks["ray"], "responses"), column(docks["local"], "responses"))
        width = embeds_width(local.policy.model)  # H = 128, beside it Qwen3-VL's deepstack level's 128
        assert width == (256 if "qwen3" in str(vlm_dir) else 128)
        assert column(docks["local"], "image_embeds").numel() == 6 * 4 * width  # 6 samples with an image x 4 tokens
        for name in ("image_embeds", "old_logprobs"):
            torch.testing.assert_close(column(docks["ray"], name), column(docks["local"], name), rtol=1e-5, atol=1e-5)
        rows = {where: [trainer.train_step(iteration) for iteration in (1, 2)]
                for where, (_, trainer) in sessions.items()}
        assert [0, 0] in slices and any(sum(images) for images in slices)  # a step with no image on one rank only
        for want, got in zip(rows["local"], rows["ray"]):
            assert sorted(got) == sorted(want)
            compared = [k for k in want if not is_wall_clock(k)]
            for key in compared:
                assert same(got[key], want[key], key), (key, got[key], want[key])
            assert want["actor/grad_norm"] > 0 and want["actor/kl_loss"] > 0 and len(compared) > 15
        before, local_weights = initial_weights(vlm_dir), local.policy.model.state_dict()
        for ray_weights in remote.cluster.state_dicts():
            for key, value in local_weights.items():
                torch.testing.assert_close(ray_weights[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, key=key: f"{key}: {m}")
        changed = {k for k in before if not torch.equal(before[k], local_weights[k])}
        assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
        path = remote.save(2, {})
        assert (path / "preprocessor_config.json").is_file() and (path / "model.safetensors").is_file()
    finally:
        for session, trainer in sessions.values():
            if trainer.source is not None:
                trainer.source.close()
            session.close()


def media_prompts(root, model_dir) -> tuple[str, int]:
    """4 prompts of colours: with a 56x56 picture, with a 4-frame video, with both, and a longer
    text-only one; preprocessed (limit_mm_video_per_prompt 1). Returns the dataset's prefix and the
    longest prompt's length in tokens (the text-only one's; a picture fills 4 tokens, a video 8)."""
    from posttrain.data.builders import build_prompt_dataset
    from posttrain.data.preprocess import preprocess
    from tests.e2e.test_e2e_multimodal_video import square_frames
    from tests.helpers.data import write_jsonl

    rows = []
    for i, (colour, image, video) in enumerate([("red", True, False), ("blue", False, True), ("green", True, True),
                                                ("black", False, False)]):
        images, videos = [], []
        if image:
            square_frames(colour, 1)[0].save(root / f"{i}.png")
            images.append(f"{i}.png")
        if video:
            for f, frame in enumerate(square_frames(colour)):
                frame.save(root / f"{i}_{f}.png")
            videos.append([f"{i}_{f}.png" for f in range(4)])
        marks = "<image> " * image + "<video> " * video
        rows.append({"problem": marks + ("colour?" if images or videos else "what colour is the square in the "
                                                                                  "picture, in one word?"),
                     "answer": colour, "images": images, "videos": videos})
    write_jsonl(root / "in.jsonl", rows)
    prefix = root / "data" / "media"
    preprocess({"input": str(root / "in.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(model_dir), "prompt_type": "qwen2_vl", "output_prefix": str(prefix),
                "map_keys": {"prompt": "problem", "response": "answer"}, "dataset_additional_keys": ["labels"],
                "workers": 1, "limit_mm_video_per_prompt": 1}, progress=False)
    items = build_prompt_dataset(str(prefix), 512, images_per_prompt=1, videos_per_prompt=1)
    lengths = [len(items[i]["prompts"]) + 3 * len(items[i]["images"]) + 7 * len(items[i]["videos"]) for i in range(4)]
    assert max(lengths) == lengths[3] > max(lengths[:3]) + 3, lengths  # the text-only prompt is the longest
    return str(prefix), lengths[3]


@pytest.fixture(scope="module")
def media_data(tiny_vlm_dir, tmp_path_factory):
    return media_prompts(tmp_path_factory.mktemp("ray_media"), tiny_vlm_dir)


# partial rollout (6 tokens in rounds of 3) with asynchronous rollout (a version behind); room for the
# text-only prompt + 3 tokens: its samples are complete after the first round, the others are cut
# there and continued with their pictures and videos
ROLLOUT_MODES = {"partial_rollout_max_split": 2, "async_staleness": 1, "guarantee_order": False}


def test_videos_with_partial_and_async_rollout_on_two_workers_equal_one_process(ray_cluster, tiny_vlm_dir,
                                                                               media_data, tmp_path, monkeypatch):
    """Videos and pictures on 2 workers (``limit_mm_video_per_prompt``), with partial rollout and
    ``async_staleness: 1``, 2 iterations: the workers' rollout copies sample the prompts with their
    images and video cells a version behind, each round a call over both workers' rows (a cut sample
    continued with its media), and the log-prob passes and the update cut the video cells with their
    rows. The same responses, old log-probs (1e-5), ages, staleness, metrics and checkpoint weights (the
    tower's too) as in one process."""
    from safetensors.torch import load_file

    from posttrain.loops.onpolicy import OnPolicyTrainer
    from tests.cluster.cluster_helpers import record_run

    data, longest = media_data
    passes = {"local": [], "ray": []}  # each run's old log-prob passes: (responses, old_logprobs, video_grid_thw)
    real_correct = OnPolicyTrainer.correct
    runs = {}
    for where, workers in (("local", 1), ("ray", 2)):
        def correct(self, td, acc, iteration, where=where):  # the dock after the old log-prob pass
            passes[where].append([column(td, name) for name in ("responses", "old_logprobs", "video_grid_thw")])
            return real_correct(self, td, acc, iteration)

        monkeypatch.setattr(OnPolicyTrainer, "correct", correct)
        runs[where] = record_run(mm_config(tiny_vlm_dir, data, tmp_path / where, workers=workers, iters=2,
                                           rl=ROLLOUT_MODES, generate={"limit_mm_video_per_prompt": 1,
                                                                       "max_model_len": longest + 3}))
    (local_batches, local_rows, _), (ray_batches, ray_rows, _) = runs["local"], runs["ray"]
    assert ray_batches == local_batches and len(local_batches) >= 2
    assert len(passes["ray"]) == len(passes["local"]) == 2
    for got, want in zip(passes["ray"], passes["local"]):
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and want[2].numel() >= 3 * 2
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    local_rows, ray_rows = [r for r in local_rows if "actor/pg_loss" in r], [r for r in ray_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in ray_rows] == [r["iteration"] for r in local_rows] == [1, 2]
    for want, got in zip(local_rows, ray_rows):
        assert sorted(got) == sorted(want)
        for key in (k for k in want if not is_wall_clock(k)):
            # GRPO's pg_loss, a mean of ratio x advantage near 0: the workers' sums leave ~1e-7 absolute (as in
            # test_ray_grpo.py's partial and async run)
            noise = key == "actor/pg_loss" and abs(want[key]) < 1e-2
            equal = got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6) if noise else same(got[key], want[key], key)
            assert equal, (want["iteration"], key, got[key], want[key])
    assert max(r["rollout/age_max"] for r in local_rows) >= 1  # samples were cut and continued
    assert local_rows[-1]["rollout/staleness_max"] >= 1  # sampled a version behind
    before = load_file(tiny_vlm_dir / "model.safetensors")  # the tiny VLM, saved as a checkpoint saves it
    want, got = (load_file(tmp_path / where / "ckpt" / "iter_0000002" / "model.safetensors") for where in ("local", "ray"))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    changed = {k for k in before if not torch.equal(before[k], want[k])}
    assert any("visual" in k for k in changed) and any("visual" not in k for k in changed)  # the tower and the LM


def test_multimodal_sft_on_two_workers_equals_one_process(ray_cluster, tiny_vlm_dir, tmp_path):
    """Multimodal SFT (stage sft) on 2 workers, 2 steps: the driver encodes each sample's images
    into the batch (no model on the driver) and every worker trains its share of the rows with their
    images (4 samples: one with two pictures, one text-only). The same loss, grad norm and token
    count a step, and the same checkpoint weights (the tower's too) as in one process."""
    from safetensors.torch import load_file

    from posttrain.commands.train import train_config as train
    from tests.e2e.test_e2e_multimodal_sft import ROWS, metrics_by_iteration, preprocess_sft, sft_config, write_rows

    (tmp_path / "data").mkdir()
    data = preprocess_sft(write_rows(tmp_path / "data", ROWS), tiny_vlm_dir, tmp_path / "data" / "sft")
    for where, workers in (("local", 1), ("ray", 2)):
        train(sft_config(tiny_vlm_dir, data, tmp_path / where, iters=2, rl_config__ray_timeout_s=120,
                         rl_config__actor_resource={"num_devices": workers}))
    local, ray = (metrics_by_iteration(tmp_path / where / "run") for where in ("local", "ray"))
    assert sorted(local) == sorted(ray) == [1, 2] and local[2]["sft/loss"] < local[1]["sft/loss"]
    for iteration, want in local.items():
        assert {"sft/loss", "sft/grad_norm", "sft/tokens"} <= set(want)
        for key in (k for k in want if not is_wall_clock(k)):
            assert ray[iteration][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (iteration, key)
    before = load_file(tiny_vlm_dir / "model.safetensors")  # the tiny VLM, saved as a checkpoint saves it
    want, got = (load_file(tmp_path / where / "ckpt" / "iter_0000002" / "model.safetensors")
                 for where in ("local", "ray"))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    changed = {k for k in before if not torch.equal(before[k], want[k])}
    assert any("visual" in k for k in changed) and any("visual" not in k for k in changed)  # the tower and the LM
    assert (tmp_path / "ray" / "ckpt" / "iter_0000002" / "preprocessor_config.json").is_file()


@pytest.fixture(scope="module")
def qwen25_data(tiny_vlm_dir, tmp_path_factory):
    """:func:`mm_data`'s prompts for the tiny Qwen2.5-VL alone."""
    return colour_prompts(tmp_path_factory.mktemp("ray_mm_fsdp2"), tiny_vlm_dir, text_only=(TEXT_ONLY,))


def test_fsdp2_with_a_frozen_tower_on_two_workers_equals_one_process(ray_cluster, tiny_vlm_dir, qwen25_data,
                                                                     tmp_path, monkeypatch):
    """``ray_sharding: fsdp2`` with images (tiny Qwen2.5-VL, ``freeze_vision_tower``), 2 iterations:
    the language model sharded over 2 workers, the frozen tower whole on each (outside FSDP2, never a
    DTensor), the image features scattered into the sharded model's forward. The same responses, old
    log-probs (1e-5), metrics, checkpoint weights and AdamW moments as in one process; the tower
    unchanged; the checkpoint loads with ``AutoModelForImageTextToText``."""
    from transformers import AutoModelForImageTextToText

    from posttrain.loops.onpolicy import OnPolicyTrainer
    from tests.cluster.cluster_helpers import record_run

    frozen = {"freeze_vision_tower": True}
    passes = {"local": [], "ray": []}  # each run's (responses, old_logprobs) after the old log-prob pass
    shares = []  # each worker's parameter bytes, trainable and frozen, during the run
    real_correct = OnPolicyTrainer.correct
    runs = {}
    for where, rl in (("local", {**frozen}), ("ray", {**frozen, "ray_sharding": "fsdp2"})):
        def correct(self, td, acc, iteration, where=where):
            passes[where].append([column(td, name) for name in ("responses", "old_logprobs")])
            if where == "ray" and not shares:
                shares.extend(self.s.cluster.parameter_bytes())
            return real_correct(self, td, acc, iteration)

        monkeypatch.setattr(OnPolicyTrainer, "correct", correct)
        runs[where] = record_run(mm_config(tiny_vlm_dir, qwen25_data, tmp_path / where,
                                           workers=1 if where == "local" else 2, iters=2, rl=rl))
    before = initial_weights(tiny_vlm_dir)
    tower = sum(v.numel() * v.element_size() for k, v in before.items() if "visual" in k)
    language = sum(v.numel() * v.element_size() for k, v in before.items() if "visual" not in k)
    assert len(shares) == 2 and all(share["frozen"] == tower for share in shares)  # the tower whole on each
    assert all(share["trainable"] < 0.75 * language for share in shares)  # the LM sharded
    (local_batches, local_rows, _), (ray_batches, ray_rows, _) = runs["local"], runs["ray"]
    assert ray_batches == local_batches and len(local_batches) == 2
    assert len(passes["ray"]) == len(passes["local"]) == 2
    for got, want in zip(passes["ray"], passes["local"]):
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    local_rows = [r for r in local_rows if "actor/pg_loss" in r]
    ray_rows = [r for r in ray_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in ray_rows] == [r["iteration"] for r in local_rows] == [1, 2]
    for want, got in zip(local_rows, ray_rows):
        assert sorted(got) == sorted(want)
        for key in (k for k in want if not is_wall_clock(k)):
            assert same(got[key], want[key], key), (want["iteration"], key, got[key], want[key])
        assert want["actor/grad_norm"] > 0
    path = {where: tmp_path / where / "ckpt" / "iter_0000002" for where in ("local", "ray")}
    want = initial_weights(path["local"])
    got = AutoModelForImageTextToText.from_pretrained(str(path["ray"])).state_dict()  # the FSDP2 run's checkpoint
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    changed = {k for k in before if not torch.equal(before[k], want[k])}
    assert changed and not any("visual" in k for k in changed)  # the LM trained, the tower frozen
    assert (path["ray"] / "preprocessor_config.json").is_file()
    # the AdamW moments, matched as a one-process resume matches them (group by group, in order)
    want, got = (torch.load(path[where] / "optimizer.pt", weights_only=False) for where in ("local", "ray"))
    assert [len(g["params"]) for g in got["param_groups"]] == [len(g["params"]) for g in want["param_groups"]]
    for want_group, got_group in zip(want["param_groups"], got["param_groups"]):
        for w, g in zip(want_group["params"], got_group["params"]):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(got["state"][g][key], want["state"][w][key], rtol=1e-3, atol=1e-8)
