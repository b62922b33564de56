"""``posttrain plan``: validate a config and print its batch plan and memory estimate."""

from __future__ import annotations

from posttrain.config.files import check_run_files
from posttrain.config.memory import rollout_layout
from posttrain.config.plan import GIB, Plan, model_arch, resolve_plan
from posttrain.config.run import load_run_config
from posttrain.config.target import Target, parse_target
from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.cpu_linear import resolve_cpu_linear

__all__ = ["format_plan", "model_arch", "run"]  # model_arch lives in posttrain.config.arch (train uses it too)


def _role_lines(plan: Plan) -> list[str]:
    """The parallel layout's lines of the roles beside the actor: a reference and a reward model in
    worker groups of their own (use_integrated_worker: false), how their calls wait, the reward model."""
    groups, lines = plan.separated.devices, []
    if "reference" in groups:
        lines.append(f"  {'reference (a worker group of its own)':<46} {groups['reference']} worker(s), its own "
                     f"placement group; rows cut into {groups['reference']} share(s)")
    if "critic" in groups:
        lines.append(f"  {'critic (a worker group of its own)':<46} {groups['critic']} worker(s), its own placement "
                     f"and process group, data parallel {groups['critic']}; checkpoints in critic_config.save")
    if groups:
        lines.append(f"  {'role calls':<46} " + ("blocking: one pass after another" if plan.separated.blocking else
                                                   "blocking: false: the log-prob (and value) passes overlap"))
    if plan.reward_model is not None:
        rm = plan.reward_model
        where = (f"a worker group of its own, {groups['reward']} worker(s)" if "reward" in groups
                 else "colocated with the actor")
        lines.append(f"  {'reward model (' + where + ')':<46} {rm.path}, {rm.dtype}, "
                     f"{rm.micro_batch_size} sequences per forward, weight {rm.weight:g}")
    return lines


def format_plan(plan: Plan, cpu_linear: str = "blas") -> str:
    """``plan`` in words; ``cpu_linear``: the fp32 linear kernel a run would choose here now (a
    run chooses it when it starts, :mod:`posttrain.models.cpu_linear`)."""
    par = plan.parallel
    sharding = plan.sharding if par.backend == "hf" else "megatron"
    where = (f"{plan.workers} Ray worker(s), {sharding}" if plan.use_ray else "in one process")
    if plan.off_policy.separate_worker:  # separate_rollout_worker: true
        where += " (trainer) and a Ray rollout worker process"
    if plan.separated:  # use_integrated_worker: false: roles in worker groups of their own
        where += " (actor), " + ", ".join(f"{count} {role} worker(s)" for role, count in plan.separated.devices.items())
    devices = plan.layout.num_devices + sum(plan.separated.devices.values())  # the actor's and the roles' own
    lines = [f"stage {plan.name} on {devices} device(s), {where}; {plan.device}, "
             f"{plan.train_dtype} training, {plan.rollout_dtype} rollout"
             + ("; fp32 linear layers by oneDNN (measured now on this machine)" if cpu_linear == "onednn" else ""),
             *([plan.target.describe(plan.layout.num_devices)] if plan.target is not None else []),
             f"backend: {par.describe()}", "",
             "batch plan (per iteration)"]
    rows = [
        ("prompts", f"{plan.prompts_per_iteration}  (global_batch_size)"),
        ("responses", f"{plan.responses_per_iteration}  (prompts x n_samples_per_prompt)"),
        *([("prompts per update", f"{plan.prompts_per_update}  (DAPO: filter_groups_train_batch_size kept "
                                  f"after dynamic sampling)")] if plan.prompts_per_update != plan.prompts_per_iteration
          else []),
        ("mini-batches", f"{plan.mini_batches_per_iteration}  of {plan.mini_batch_rows} responses"),
        ("optimizer steps", f"{plan.optimizer_steps_per_iteration}  (mini-batches x epochs)"),
        ("optimizer steps in all", f"{plan.total_optimizer_steps}  (the LR schedule's length)"),
        ("responses per mini-batch per DP rank", str(plan.responses_per_mini_batch_per_dp)),
        ("micro-batch size", f"{plan.micro_batch_size} sequences"),
        ("micro-batches (grad accumulation) per update", str(plan.grad_accumulation_steps)),
        ("max tokens per sequence", f"{plan.max_tokens_per_sequence}  (prompt <= {plan.max_prompt_length}, "
                                    f"response <= {plan.max_response_tokens})"),
        ("max tokens per iteration", f"{plan.max_tokens_per_iteration:,}"),
    ]
    if plan.multi_turn:
        rows.append(("multi-turn rollout", plan.multi_turn))
    if plan.multimodal is not None:  # rl_config.is_multimodal (docs/multimodal.md)
        rows.append(("multimodal", plan.multimodal.describe()))
    if plan.off_policy_rollout:
        rows.append(("off-policy rollout", plan.off_policy_rollout))
    if plan.train_iters:
        rows.append(("iterations", f"{plan.train_iters}  ({plan.train_iters * plan.prompts_per_iteration:,} "
                                   f"prompts in all)"))
    lines += [f"  {k:<46} {v}" for k, v in rows]
    lines += ["", "parallel layout",
              f"  {'actor':<46} data parallel {par.dp} (tensor parallel {par.tp}, pipeline parallel {par.pp})",
              f"  {'rollout':<46} {rollout_layout(plan)}; the seed's rollout data parallel "
              f"{plan.layout.infer_dp} sizes the reads"]
    lines += _role_lines(plan)
    if plan.dispatch_sizes:
        lines += ["", "dispatch sizes (TransferDock reads per data-parallel rank)"]
        lines += [f"  {k:<46} {v}" for k, v in sorted(plan.dispatch_sizes.items())]
    if plan.memory is not None and plan.arch is not None:
        m = plan.memory
        per = "per device (one worker process each)" if plan.target is not None else "per worker process"
        lines += ["", f"memory {per} ({plan.num_params / 1e9:.2f}B parameters, estimate)"]
        for name, value in ((_weights_label(plan), m.weights), ("gradients", m.gradients),
                            ("optimizer states (AdamW)", m.optimizer),
                            (f"reference (frozen copy, {plan.frozen_dtype})", m.reference),
                            ("critic (weights, gradients, AdamW)", m.critic),
                            ("reward model (frozen weights)", m.reward_model),
                            ("activations (one micro-batch)", m.activations), ("rollout KV cache", m.kv_cache),
                            (_rollout_copy_label(plan), m.rollout_copy)):
            if value:
                lines.append(f"  {name:<46} {value / GIB:8.2f} GiB")
        sleeps = " (vLLM asleep)" if m.rollout_sleeps else ""
        off = f" ({' and '.join(m.off_during_rollout)} offloaded)" if m.off_during_rollout else ""
        for name, value in ((f"update peak{sleeps}", m.update_peak), (f"rollout peak{off}", m.rollout_peak),
                            ("total (the larger peak)", m.total)):
            lines.append(f"  {name:<46} {value / GIB:8.2f} GiB")
        if plan.target is not None:
            size = plan.target.memory_bytes
            lines.append(f"  {'the target (' + plan.target.text + ')':<46} {size / GIB:8.2f} GiB per "
                         f"{'node' if plan.target.kind == 'cpu' else 'device'}")
    else:
        lines += ["", "memory: no model architecture known (give --hf-config or a model yaml)"]
    return "\n".join(lines)


def _weights_label(plan: Plan) -> str:
    bf16_main = plan.parallel.backend == "megatron" and plan.train_dtype == "bfloat16"
    if plan.lora:
        return f"weights ({plan.frozen_dtype} frozen base, {'bf16' if bf16_main else 'fp32'} adapter)"
    return "weights (bf16; fp32 main params in optimizer)" if bf16_main else "weights (fp32 master)"


def _rollout_copy_label(plan: Plan) -> str:
    if plan.rollout is not None and plan.rollout.vllm is not None:
        return f"rollout copy (vLLM, 1/{plan.rollout.vllm.tensor_parallel_size} of the model)"
    if plan.lora:
        return "LoRA merge copy (adapted base weights)"
    if plan.parallel.backend == "megatron":
        return "rollout copy (whole model, replica leaders)"
    return "rollout copy (the native engine's bf16 copy)"


def run(args) -> int:
    cfg = load_run_config(args.config_name, args.config_path, args.overrides)
    target = _target(args)
    config_only = bool(getattr(args, "config_only", False)) or target is not None
    plan = resolve_plan(cfg, model_arch(cfg, args.hf_config) if args.hf_config else None, target=target)
    if not config_only:  # the files it reads and writes, as `posttrain train` checks them at start-up
        try:
            check_run_files(plan)
        except PosttrainError as err:
            raise type(err)(f"{err}\n(posttrain plan checks the files a config names, as train does; "
                            "--config-only checks the config alone)") from err
    if target is not None:
        note = (f" for {target.text} (--target: the files it names were not checked; train checks them on the "
                f"target machine)")
    elif config_only:
        note = (" as a config (--config-only: the datasets, model and directories it names were not checked; "
                "train checks them at start-up)")
    else:
        note = ""
    print(f"config {cfg.path}: valid{note}")
    for warning in plan.warnings:
        print(f"warning: {warning}")
    print(format_plan(plan, resolve_cpu_linear(plan.device) if target is None else "blas"))
    return 0


def _target(args) -> Target | None:
    """``--target`` with ``--nodes`` / ``--devices-per-node`` (which need it)."""
    text = getattr(args, "target", None)
    nodes, per_node = getattr(args, "nodes", None), getattr(args, "devices_per_node", None)
    if text is None:
        if nodes is not None or per_node is not None:
            raise ConfigError("--nodes and --devices-per-node describe a --target cluster; give --target too "
                              "(e.g. --target cuda:80GiB)")
        return None
    return parse_target(text, nodes, per_node)
