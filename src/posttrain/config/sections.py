"""``rl_config``, ``generate_config`` (with ``sampling_config``), ``profiler_config``, ``msprobe_config``.

Keys and defaults are the seed's (reference: seed_system.md 3.2, 3.3, 3.5). Keys marked
"posttrain:" are this project's additions. Every key carries its status (:mod:`posttrain.config.fields`):
honoured, refused (:func:`posttrain.config.features.check_features` raises) or ignored (listed in one
start-up warning by :func:`posttrain.config.features.startup_warnings`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AliasChoices, Field, model_validator

from posttrain.config.fields import HONOURED, F, Section, ignored, refused

Opt = Optional
ROWS_PER_READ = "rows per read; null: derived as the seed does"
WEIGHT = Annotated[float, Field(ge=0, allow_inf_nan=False)]
KL_CONTROLLERS = Literal["fixed", "adaptive"]
SHARDINGS = Literal["ddp", "fsdp2"]
CORRECTIONS = Literal["none", "tis", "mis", "icepop"]  # posttrain.algo.rollout_correction.MODES
CORRECTION_LEVELS = Literal["token", "sequence"]  # posttrain.algo.rollout_correction.LEVELS
TRUNCATE_SIDES = Literal["left", "right", "middle"]
TURN_CREDITS = Literal["trajectory", "turn"]  # posttrain.algo.turn_credit.TURN_CREDITS
DISTILL_MODES = Literal["reverse_kl", "mixed"]  # posttrain.algo.distill.DISTILL_MODES
ROLLOUT_DTYPES = Literal["bfloat16", "float32", "float16"]

SEED_UNUSED = ignored("unused, as in the seed")
HCCL = ignored("Ascend NPUs only (exported as HCCL_BUFFSIZE to Ray workers, where nothing reads it)")
WHITEN = ignored("GAE advantages are always whitened, as in the seed", ok=(True,))
RAY_CPUS = ignored("Ray CPU reservations are set by rl_config.ray_num_cpus_per_worker")
VALIDATED_ONLY = ignored("checked as in the seed, but this step reads the whole batch at once", active="set")
ZMQ = ignored("TransferDock data moves in process (or through Ray), never over ZMQ or HCCL")
COMPUTED = ignored("computed from the devices (actor devices / (infer TP x infer PP)), as in the seed", active="set")
GEN_TOKENIZER = ignored("rollout uses the actor's tokenizer (megatron_training.tokenizer_name_or_path)")
# vllm=True: with rl_config.rollout_engine: vllm, posttrain.config.vllm passes the key to vLLM or refuses it
REMOTE_CODE = ignored("models and tokenizers load without remote code (a model that needs it fails to load)",
                      vllm=True)
ROLLOUT_PARALLEL = ignored("every worker rolls out with a full model replica (no rollout model parallelism); the "
                           "value only sizes the rollout reads (devices / infer TP)", active="gt1", explicit=False,
                           vllm=True)
ROLLOUT_EP = ignored("every worker rolls out with a full model replica (no rollout expert parallelism)", vllm=True)
ROLLOUT_EP_SIZE = ignored("every worker rolls out with a full model replica (no rollout expert parallelism)",
                          active="gt1", vllm=True)
VLLM_ONLY = ignored("a vLLM setting: only rl_config.rollout_engine: vllm reads it", vllm=True)
# false: the native engine decodes with CUDA graphs on a GPU (posttrain.rollout.native); a CPU runs eagerly
EAGER = ignored("on a CPU the native engine runs eagerly (CUDA graphs need a GPU)", ok=(True,), devices=("cpu",),
                vllm=True)
VLLM_ASCEND = ignored("Ascend NPUs only", vllm=True)
LOGPROBS = ignored("the engines return the sampled token's log-prob only", ok=(None, 0, 1))
DETOKENIZE = ignored("the engines return token ids; the reward step decodes them")

INTEGRATED = HONOURED  # false: the seed's separated roles (posttrain.config.separated)
BLOCKING = HONOURED  # false: the separated roles' passes overlap (compat.py refuses it in integrated mode)
REFERENCE_RESOURCE = HONOURED  # separated mode: the reference's own group (validate.py: integrated mode forbids it)
# integrated mode: colocated with the actor, so only the actor's count; separated mode: the group of its own
REWARD_RESOURCE = refused("in integrated mode the reward model runs on the actor's devices (loaded in the actor's "
                          "process or in each actor worker)", "remove the key, give it actor_resource's num_npus, or "
                          "set use_integrated_worker: false (a group of its own)", active="actor_devices")
CRITIC_RESOURCE = refused("in integrated mode the critic runs on the actor's devices (in the actor's process or "
                          "workers)", "remove the key, give it actor_resource's num_npus, or set "
                          "use_integrated_worker: false (a group of its own)", active="actor_devices")
# multimodal (docs/multimodal.md): the keys that need is_multimodal: true, or another feature, are refused by
# the compatibility table (compat.py rows mm-*)
VIT_RESOURCE = refused("the ViT on devices of its own waits for separated ViT roles (a ViT worker group); the vision "
                       "tower runs in the actor's process, on its devices", "remove the key", active="set")
VIT_COLOCATED = ignored("posttrain always runs the vision tower in the actor's process, on its devices (a ViT of its "
                        "own needs vit_resource, which is refused)")
DP_BALANCE = HONOURED  # Ray workers: cluster/group.py balances the replicas' shares; one process: compat row
# td: the TransferDock keeps the cells in the driver; tq: in TransferQueue (posttrain.cluster.transfer_queue)
DATA_STRATEGY = HONOURED
QUEUE_STRATEGIES = ("tq", "transfer_queue", "queue")  # the seed's names of data_strategy: tq
DATA_STRATEGIES = Literal["td", "transfer_dock", "dock", "tq", "transfer_queue", "queue"]
TQ = HONOURED  # TransferQueue's storage units; compat.py refuses it without data_strategy: tq
TQ_SET = refused("TransferQueue (transferqueue 0.1.11) binds its ZMQ sockets to free ports that it picks itself; "
                 "it has no port setting", "remove the key", active="set", group="transfer queue")
PARTIAL = HONOURED  # posttrain.config.async_rollout checks these keys; loops/partial_rollout.py runs them
MULTI_TURN = HONOURED  # posttrain.config.multi_turn checks these keys; rollout/multi_turn.py runs them
SHARE_BACKBONE = HONOURED  # the reference is the actor with its LoRA adapter off (validate.py checks it)
EPLB = refused("expert load balancing (EPLB) is not implemented", group="eplb")
EPLB_PATH = refused("expert load balancing (EPLB) is not implemented", switch="eplb_token_collects")
EPLB_SET = refused("expert load balancing (EPLB) is not implemented", "remove the key", active="set", group="eplb")
ROLLOUT_PP = refused("pipeline-parallel rollout is not available", "set it to 1", active="gt1")
# on a GPU the optimizer state leaves the device between updates (posttrain.training.offload); on a CPU
# host and device memory are the same: no effect there
OFFLOAD = ignored("on a CPU the host memory is the device memory", devices=("cpu",))
# the weights on the host during rollout where the engine samples from a copy (posttrain.training.offload); the
# setups whose rollout reads the training weights themselves are refused in config/compat.py
OFFLOAD_PARAM = OFFLOAD
PREFIX_CACHING = refused("prefix caching across requests is not available in the native engine, which has no "
                         "repeated prefix across its calls to reuse: a call prefills each prompt once for its n "
                         "samples, the next call follows an optimizer step (new weights make every cached entry "
                         "stale), and multi-turn keeps each conversation's KV cache across its turns (tiny_qwen2 on a "
                         "CPU, benchmarks/rollout/prefix_cache_headroom.py: re-prefilling turn 2 is 60-80% of the "
                         "turn, which the kept cache already saves; a GRPO call's shared prefill is 10-16% of the "
                         "call); rl_config.rollout_engine: vllm has it", vllm=True)
PROFILER = HONOURED  # posttrain.metrics.profiler: torch.profiler over the seed's step window
PROFILER_KEY = HONOURED
MSPROBE = HONOURED  # posttrain.metrics.dumps: statistics per tensor over the seed's step window
MSPROBE_KEY = HONOURED


class Resource(Section):
    num_npus: Opt[int] = F(None, "devices (or CPU worker processes) for the role; num_gpus and num_devices are "
                                 "aliases", HONOURED, ge=0, note="devices, or CPU worker processes; 0 or 1: one "
                                                                 "process",
                           validation_alias=AliasChoices("num_npus", "num_gpus", "num_devices"))

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data: Any) -> Any:
        if isinstance(data, dict):
            names = [k for k in ("num_npus", "num_gpus", "num_devices") if k in data]
            if len(names) > 1:
                raise ValueError(f"give only one of {', '.join(names)}: they name the same count")
        return data


class RLConfig(Section):
    runtime_env_path: str = F("configs/envs/runtime_env.yaml", "Ray runtime env file", HONOURED)
    hccl_buffersize: int = F(256, "Ascend HCCL buffer size (MB)", HCCL)
    rule_reward: bool = F(True, "score rollouts with the rule verifiers (false: the reward model of reward_config "
                                "alone)", HONOURED)
    beta: float = F(0.1, "rule/model reward balance", SEED_UNUSED)
    actor_resource: Resource = F(Resource(), "devices for the actor", HONOURED)
    reference_resource: Opt[Resource] = F(None, "separated mode: the reference's own worker group", REFERENCE_RESOURCE)
    reward_resource: Opt[Resource] = F(None, "reward-model devices (reward_config); separated mode: its own worker "
                                             "group", REWARD_RESOURCE)
    critic_resource: Opt[Resource] = F(None, "critic devices (PPO); separated mode: its own worker group",
                                       CRITIC_RESOURCE)
    vit_resource: Opt[Resource] = F(None, "multimodal: ViT devices", VIT_RESOURCE)
    num_samples_per_step: int = F(1, "samples per step", SEED_UNUSED)
    max_prompt_length: int = F(512, "prompts with token length >= this are filtered out", HONOURED, ge=1,
                               note="prompts this long or longer are dropped")
    epochs: int = F(1, "passes over the mini-batches per iteration", HONOURED, ge=1,
                    note="passes over each iteration's mini-batches")
    clip_ratio: float = F(0.2, "PPO/GRPO clip epsilon", HONOURED, ge=0, finite=True,
                          note="the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio]")
    clip_ratio_c: Opt[float] = F(None, "posttrain: dual-clip PPO constant (e.g. 3.0); None disables", HONOURED, gt=1,
                                 finite=True, note="dual-clip PPO, e.g. 3.0; null turns it off")
    cliprange_value: float = F(0.5, "critic value clip", HONOURED, gt=0, finite=True,
                               note="the critic's value clip; the seed's default is 0.5")
    entropy_coeff: float = F(0.0, "entropy bonus weight", HONOURED, ge=0, finite=True,
                             note="the weight of the entropy bonus; 0 turns it off")
    gamma: float = F(1.0, "discount (GAE, REINFORCE++, turn_credit: turn)", HONOURED, ge=0, le=1)
    lam: float = F(0.95, "GAE lambda", HONOURED, ge=0, le=1)
    advantage_whiten: bool = F(True, "whiten GAE advantages", WHITEN)
    kl_penalty: str = F("low_var_kl", "kl, abs, mse or low_var_kl", HONOURED)
    kl_ctrl_type: KL_CONTROLLERS = F("fixed", "fixed or adaptive", HONOURED)
    init_kl_coef: float = F(0.01, "KL coefficient", HONOURED, ge=0, finite=True,
                            note="the KL coefficient; 0 turns the KL term off")
    kl_horizon: float = F(1000, "adaptive KL horizon", HONOURED)
    kl_target: float = F(100.0, "adaptive KL target", HONOURED, gt=0, finite=True)
    adv_estimator: str = F("group_norm", "group_norm, gae, grpo_no_std, rloo, reinforce_plus_plus, ...", HONOURED)
    policy_loss: str = F("ppo", "posttrain: ppo (clipped surrogate; dual-clip with clip_ratio_c), gspo, cispo, sapo "
                                "or gpg (docs/algorithms.md)", HONOURED)
    sapo_tau_pos: Opt[float] = F(None, "posttrain: SAPO's gate temperature where the advantage is positive (policy_loss: "
                                       "sapo; default 1.0)", HONOURED, gt=0, finite=True, note="the gate's temperature")
    sapo_tau_neg: Opt[float] = F(None, "posttrain: SAPO's gate temperature where the advantage is not positive "
                                       "(policy_loss: sapo; default 1.05)", HONOURED, gt=0, finite=True,
                                 note="the gate's temperature")
    loss_agg_mode: Opt[str] = F(None, "posttrain: token-mean, seq-mean-token-mean, seq-mean-token-sum or "
                                      "seq-mean-token-sum-norm; default: the algorithm's (DAPO: token_level_loss)",
                                HONOURED)
    verifier_function: list[str] = F(["base_acc"], "rule verifiers", HONOURED)
    verifier_weight: list[WEIGHT] = F([1.0], "weights, one per verifier", HONOURED,
                                     note="the weight of the verifier at the same place in verifier_function")
    verifier_parallel: int = F(1, "verifier worker processes (honoured, unlike the seed)", HONOURED, ge=0,
                                note="verifier worker processes; 0 scores inline")
    verifier_timeout: float = F(30, "seconds per sample (honoured, unlike the seed)", HONOURED, gt=0, finite=True,
                               note="seconds one sample may take")
    verifier_modules: list[str] = F([], "posttrain: modules that register user verifiers", HONOURED)
    integrated_mode_config: Opt[dict[str, Any]] = F(None, "integrated mode: ref_model_load_path", HONOURED)
    use_kl_in_reward: bool = F(False, "PPO: subtract beta*KL from token rewards", HONOURED)
    shuffle_mini_batch: bool = F(False, "shuffle mini-batch order", HONOURED)
    tp_split_expert: bool = F(False, "split MoE experts over TP", SEED_UNUSED)
    use_tensorboard: bool = F(False, "write TensorBoard logs", HONOURED)
    tensorboard_log_dir: Opt[str] = F(None, "TensorBoard directory (default: <run dir>/tensorboard)", HONOURED)
    use_wandb: bool = F(False, "log to wandb", HONOURED)
    wandb_project: str = F("", "wandb project", HONOURED)
    wandb_exp_name: str = F("", "wandb run name", HONOURED)
    wandb_save_dir: str = F("", "wandb directory", HONOURED)
    use_trackio: bool = F(False, "posttrain: log to trackio (local-first; the [trackers] extra)", HONOURED)
    trackio_project: str = F("", "posttrain: trackio project (default posttrain)", HONOURED)
    use_mlflow: bool = F(False, "posttrain: log to MLflow (the [trackers] extra)", HONOURED)
    mlflow_tracking_uri: str = F("", "posttrain: MLflow tracking URI (default file:<run dir>/mlruns)", HONOURED)
    mlflow_experiment: str = F("", "posttrain: MLflow experiment (default posttrain)", HONOURED)
    use_swanlab: bool = F(False, "log to SwanLab (the [trackers] extra)", HONOURED)
    swanlab_mode: str = F("", "SwanLab mode: local (default; files only) or cloud (needs SWANLAB_API_KEY)",
                          HONOURED)
    swanlab_project: str = F("", "SwanLab project (default posttrain)", HONOURED)
    swanlab_exp_name: str = F("", "SwanLab experiment (default: the run dir's name)", HONOURED)
    swanlab_save_dir: str = F("", "SwanLab directory (default <run dir>/swanlab)", HONOURED)
    blocking: bool = F(True, "synchronous (blocking) calls between roles; false (separated roles only): the "
                             "independent passes of an iteration overlap", BLOCKING)
    async_engine: bool = F(False, "per-request admission in the native engine (required for multi-turn)", MULTI_TURN)
    guarantee_order: bool = F(False, "deterministic TransferDock order", HONOURED)
    num_cpus_for_local_task: float = F(1, "CPUs per rule-reward Ray task", RAY_CPUS)
    num_cpus_for_placement_group: int = F(8, "CPUs per device bundle", RAY_CPUS)
    use_integrated_worker: bool = F(True, "actor, rollout, reference and reward model colocated in one worker; "
                                          "false: the roles with reference_resource / reward_resource in Ray worker "
                                          "groups of their own (docs/cluster.md); false without them: deprecated "
                                          "spelling of separate_rollout_worker", INTEGRATED)
    separate_rollout_worker: bool = F(False, "posttrain: the rollout in a Ray worker process of its own, the trainer "
                                             "in this one (docs/async.md)", HONOURED)
    use_dp_batch_balance: bool = F(False, "sequence-length-balanced data-parallel split: each replica's share of a pass "
                                 "(and of every update mini-batch) balanced by prompt + response tokens", DP_BALANCE)
    ref_forward_micro_batch_size: Opt[int] = F(None, "reference log-prob micro batch", HONOURED, ge=1)
    actor_forward_micro_batch_size: Opt[int] = F(None, "old log-prob micro batch", HONOURED, ge=1)
    vit_forward_micro_batch_size: Opt[int] = F(None, "multimodal: images per vision-tower forward in every pass "
                                                        "(log-probs and update); unset: a micro-batch's images at once",
                                                  HONOURED, ge=1, note="images per vision-tower forward")
    actor_rollout_dispatch_size: Opt[int] = F(None, "TD read size for rollout", HONOURED, ge=1, note=ROWS_PER_READ)
    actor_logprob_dispatch_size: Opt[int] = F(None, "TD read size for old log-probs", HONOURED,
                                              ge=1, note=ROWS_PER_READ)
    ref_dispatch_size: Opt[int] = F(None, "TD read size for reference log-probs", HONOURED, ge=1, note=ROWS_PER_READ)
    reward_dispatch_size: Opt[int] = F(None, "TD read size for rewards", HONOURED, ge=1, note=ROWS_PER_READ)
    dynamic_sampling_dispatch_size: Opt[int] = F(None, "TD read size for DAPO filtering", VALIDATED_ONLY,
                                                 ge=1, note=ROWS_PER_READ)
    adv_dispatch_size: Opt[int] = F(None, "TD read size for advantages", HONOURED, ge=1, note=ROWS_PER_READ)
    actor_update_dispatch_size: Opt[int] = F(None, "TD read size for the update", HONOURED, ge=1, note=ROWS_PER_READ)
    critic_update_dispatch_size: Opt[int] = F(None, "TD read size for the critic update", HONOURED,
                                              ge=1, note=ROWS_PER_READ)
    critic_value_dispatch_size: Opt[int] = F(None, "TD read size for critic values", HONOURED, ge=1, note=ROWS_PER_READ)
    kl_dispatch_size: Opt[int] = F(None, "TD read size for KL-in-reward", VALIDATED_ONLY, ge=1, note=ROWS_PER_READ)
    actor_image_embeds_dispatch_size: Opt[int] = F(None, "multimodal: TD read size for image embeddings "
                                                         "(reuse_image_embeds)", HONOURED, ge=1, note=ROWS_PER_READ)
    is_multimodal: bool = F(False, "multimodal model and data: each prompt's images (the dataset's media store) go "
                                         "to the rollout and the log-prob passes (hf backend, docs/multimodal.md)",
                            HONOURED)
    use_remove_padding: bool = F(True, "pack valid tokens of a micro-batch into one row (posttrain's default: "
                                       "true, exact and faster; the seed's: false; false pads every row)", HONOURED)
    share_prompt_prefix: bool = F(True, "posttrain: with use_remove_padding, pack every prefix that several "
                                        "rows share once (a group's prompt, a common system prompt, answers' common "
                                        "beginnings)", HONOURED)
    compile_regions: bool | Literal["auto"] = F(
        False, "posttrain: the hf backend's update runs the RMSNorm, SiLU-mul, rotary and LM-head log-softmax-gather "
        "of Llama-family models as torch.compile (Inductor) regions; exact within 1e-5, compiled once per process "
        "(CPU); auto: at the first update, only the regions whose measured saving over the run's iterations beats "
        "their compile time (run.json records why; docs/performance.md)", HONOURED)
    reuse_image_embeds: bool = F(False, "multimodal: the vision tower runs once per iteration (phase "
                                              "image_embeds) and every pass reuses its image embeddings", HONOURED)
    freeze_vision_tower: bool = F(False, "posttrain: multimodal: the vision tower gets no gradient (the seed's "
                                         "docs name no such key)", HONOURED)
    colocate_actor_and_vit: bool = F(False, "multimodal: ViT on the actor's devices", VIT_COLOCATED)
    n_samples_per_prompt: int = F(1, "group size n", HONOURED, ge=1, note="responses per prompt")
    mini_batch_size: int = F(1, "prompts per optimizer step", HONOURED, ge=1, note="prompts per optimizer step")
    use_dynamic_bsz: bool = F(False, "token-budget micro-batches", HONOURED)
    max_packing_token_size: int = F(4096, "token budget base", HONOURED, ge=1)
    ref_max_packing_token_size: int = F(4096, "reference token budget", HONOURED, ge=1)
    actor_max_packing_token_size: int = F(4096, "old log-prob token budget", HONOURED, ge=1)
    update_max_packing_token_size: int = F(4096, "update token budget", HONOURED, ge=1)
    dynamic_max_batch_size: Opt[int] = F(None, "max sequences per dynamic micro-batch", HONOURED, ge=1)
    ref_dynamic_max_batch_size: Opt[int] = F(None, "reference", HONOURED, ge=1)
    actor_dynamic_max_batch_size: Opt[int] = F(None, "old log-prob", HONOURED, ge=1)
    update_dynamic_max_batch_size: Opt[int] = F(None, "update", HONOURED, ge=1)
    log_max_throughput: bool = F(True, "tps from max lengths instead of mean", HONOURED)
    token_level_loss: bool = F(True, "DAPO: token-mean (true) or seq-mean-token-mean", HONOURED)
    data_strategy: DATA_STRATEGIES = F("td", "td (TransferDock) or tq (TransferQueue)", DATA_STRATEGY)
    transfer_queue_data_shard_num: int = F(1, "TransferQueue shards", TQ, ge=1, note="TransferQueue storage units")
    transfer_queue_data_shard_port_base: Opt[int] = F(None, "TransferQueue first port", TQ_SET)
    clip_higher_enable: bool = F(False, "DAPO clip-higher", HONOURED)
    clip_ratio_low: float = F(0.1, "DAPO lower clip", HONOURED, ge=0, finite=True)
    clip_ratio_high: float = F(0.1, "DAPO upper clip", HONOURED, ge=0, finite=True)
    overlong_buffer_enable: bool = F(False, "DAPO overlong penalty", HONOURED)
    overlong_buffer: int = F(0, "DAPO overlong buffer tokens", HONOURED, ge=0)
    overlong_buffer_penalty_factor: float = F(1.0, "DAPO overlong penalty factor", HONOURED, ge=0, finite=True)
    rollout_max_tokens: int = F(2048, "must equal sampling_config.max_tokens", HONOURED, ge=1)
    filter_groups_enable: bool = F(False, "DAPO dynamic sampling", HONOURED)
    filter_groups_metric: str = F("acc", "verifier whose score std must be nonzero", HONOURED)
    filter_groups_max_batches: int = F(1, "generation batches cap (<=0 unlimited)", HONOURED)
    filter_groups_train_batch_size: int = F(1, "prompts to keep per iteration", HONOURED, ge=1,
                                                note="prompts kept per iteration")
    zmq_communication: bool = F(True, "ZMQ instead of an HCCL broadcast for TransferDock fan-out", ZMQ)
    partial_rollout_max_split: int = F(1, "> 1: split long generations over iterations (partial rollout)",
                                       PARTIAL, ge=1, note="1: off")
    require_max_age_all_finished: bool = F(True, "partial rollout: the oldest samples finish before an update", PARTIAL)
    multi_turn_enable: bool = F(False, "agentic multi-turn rollout with tools", MULTI_TURN)
    tool_config_path: Opt[str] = F(None, "multi-turn: tools file (docs/tools.md)", MULTI_TURN)
    max_tool_calls: int = F(0, "multi-turn: the most tool calls of one sample", MULTI_TURN, ge=0)
    max_parallel_calls: int = F(0, "multi-turn: the most calls run per turn (0: all)", MULTI_TURN, ge=0,
                                 note="0: no limit")
    max_total_response_length: int = F(0, "multi-turn: response tokens over all turns", MULTI_TURN, ge=0)
    max_tool_response_length: int = F(0, "multi-turn: characters kept of one tool output (0: all)", MULTI_TURN,
                                       ge=0, note="0: no limit")
    tool_response_truncate_side: Opt[TRUNCATE_SIDES] = F(None, "multi-turn: keep the left (default), right or "
                                                               "middle of a long tool output", MULTI_TURN)
    tool_parser_format: Opt[str] = F(None, "multi-turn: tool-call parser (hermes, the default)", MULTI_TURN)
    turn_credit: TURN_CREDITS = F("trajectory", "posttrain: multi-turn advantages per trajectory or per assistant "
                                                "turn (docs/algorithms.md)", HONOURED,
                                  note="turn: each assistant turn its own return from the turns after it")
    share_backbone: bool = F(False, "LoRA: the reference is the actor with the adapter off", SHARE_BACKBONE)
    missing_eos_penalty: float = F(1.0, "penalty for a response without EOS", SEED_UNUSED)
    # ---- posttrain additions --------------------------------------------------------------------
    ray_address: Opt[str] = F(None, "posttrain: Ray cluster address (or RAY_ADDRESS)", HONOURED)
    ray_timeout_s: float = F(600.0, "posttrain: seconds any Ray remote call or torch.distributed collective may "
                                    "take", HONOURED, gt=0, finite=True)
    ray_num_cpus_per_worker: int = F(1, "posttrain: CPUs (and torch threads) per actor worker without accelerators",
                                     HONOURED, ge=1)
    ray_sharding: SHARDINGS = F("ddp", "posttrain: Ray actor workers: ddp (full replicas) or fsdp2 (sharded "
                                       "parameters, gradients and optimizer state)", HONOURED)
    reward_model_weight: float = F(1.0, "posttrain: weight of the reward model's score (reward_config): score = "
                                        "rule score (if rule_reward) + reward_model_weight x reward-model score",
                                   HONOURED, finite=True)
    judge_path: Opt[str] = F(None, "posttrain: LLM-as-judge reward (docs/rewards.md): a causal-LM directory, or "
                                   "'policy' (the self-judge: the actor rates with this step's weights)", HONOURED)
    judge_template: Opt[str] = F(None, "posttrain: judge prompt, inline (with {prompt} {response} {reference}) or "
                                       "a file path; default asks for 'Score: N', N in 0-10", HONOURED)
    judge_parser: str = F("score", "posttrain: judge score parser: score ('Score: N'), boxed (\\boxed{N}) or a "
                                   "regex with one capture group", HONOURED)
    judge_max_score: float = F(10.0, "posttrain: the top of the judge's scale (a score is divided by it)", HONOURED,
                               gt=0, finite=True)
    judge_weight: float = F(1.0, "posttrain: score = rule score + reward_model_weight x reward model + "
                                 "judge_weight x judge score (in [0, 1])", HONOURED, finite=True)
    judge_max_tokens: int = F(16, "posttrain: the most tokens of one judge reply", HONOURED, ge=1)
    judge_temperature: float = F(0.0, "posttrain: judge sampling temperature (0: greedy; else seeded by the run's "
                                      "seed)", HONOURED, ge=0, finite=True)
    judge_timeout: float = F(300.0, "posttrain: seconds one reward read's judging may take; replies not finished "
                                    "then score judge_failure_value", HONOURED, gt=0, finite=True)
    judge_failure_value: float = F(0.0, "posttrain: the judge score of a reply without a score, or cut by the "
                                        "timeout", HONOURED, finite=True)
    offload_reference: bool = F(False, "posttrain: the frozen reference off the device between its uses (GPU: in "
                                       "host memory; CPU: dropped, and mapped back from a file for each use)",
                                HONOURED)
    device: str = F("auto", "posttrain: auto, cpu, cuda or cuda:N", HONOURED)
    rollout_engine: str = F("auto", "posttrain: auto (vLLM on a GPU where the layout runs it and vllm is installed, "
                                    "else native), native or vllm", HONOURED)
    output_dir: Opt[str] = F(None, "posttrain: run directory for metrics (default runs/<config>)", HONOURED)
    env_config: Opt[dict[str, Any]] = F(None, "posttrain: train on an environment's tasks and rewards instead of "
                                              "data_path and the rule verifiers: {type: verifiers or openenv, id, "
                                              "args, limit, resets, max_turns} (docs/environments.md)", HONOURED)
    eval_data_path: Opt[str] = F(None, "posttrain: held-out prompt dataset prefix for eval during training", HONOURED)
    eval_interval: int = F(0, "posttrain: evaluate every N iterations (0: only before and after)", HONOURED,
                           ge=0)
    eval_limit: Opt[int] = F(None, "posttrain: evaluate at most this many prompts", HONOURED, ge=1)
    async_staleness: Opt[int] = F(None, "posttrain: asynchronous training: iteration i samples with the policy of "
                                        "iteration max(0, i-1-k) on its own copy of the weights while the trainer "
                                        "updates (k >= 0; unset: synchronous; docs/async.md)", HONOURED, ge=0,
                                  note="0: the rollout uses the latest weights; k: weights at most k updates old; "
                                       "remove the key for synchronous training")
    rollout_correction: CORRECTIONS = F("none", "posttrain: none, tis (truncated importance weights), mis (masked) "
                                                "or icepop (weighted inside a band, masked outside) between the "
                                                "trainer's old log-probs and the rollout's (docs/async.md)", HONOURED)
    rollout_correction_cap: float = F(2.0, "posttrain: the cap C of tis / the upper edge of the band of mis and icepop "
                                           "(> 1)", HONOURED, gt=1, finite=True,
                                      note="tis caps the ratio at C; mis and icepop keep tokens whose ratio is at most "
                                           "C")
    rollout_correction_floor: Opt[float] = F(None, "posttrain: the lower edge of the band of mis and icepop (default "
                                                   "1/C; IcePop's paper: 0.5 with C = 5)", HONOURED, gt=0, lt=1,
                                             note="the smallest ratio kept")
    rollout_correction_level: CORRECTION_LEVELS = F("token", "posttrain: token or sequence (mis: a sequence's "
                                                             "geometric-mean ratio)", HONOURED)
    truncated_sampling_logprobs: bool = F(False, "posttrain: take log-probs under the truncated, renormalised "
                                                 "sampling distribution (top_k, top_p, min_p): the rollout reports "
                                                 "log mu(y) and the actor's old and current log-probs renormalise over "
                                                 "the same kept set, so on-policy ratios are exactly 1 "
                                                 "(docs/algorithms.md)", HONOURED)
    num_threads: Opt[int] = F(None, "posttrain: torch CPU threads of an in-process run (unset: torch's count, "
                                    "lowered to the cores other processes leave free at the start, and kept on "
                                    "resume; OMP_NUM_THREADS pins it; Ray workers: ray_num_cpus_per_worker)",
                              HONOURED, ge=1, note="torch threads; unset: chosen from the free cores")
    teacher_model: Opt[str] = F(None, "posttrain: on-policy distillation: the teacher (an HF model directory or "
                                      "checkpoint with the actor's vocabulary) that scores the student's own samples "
                                      "token by token (docs/algorithms.md)", HONOURED)
    distill_mode: DISTILL_MODES = F("reverse_kl", "posttrain: with teacher_model: reverse_kl (the advantage is "
                                                  "distill_coef x the per-token reverse-KL estimate log q - log pi) or "
                                                  "mixed (the task reward's advantage plus it)", HONOURED)
    distill_coef: float = F(1.0, "posttrain: with teacher_model: the weight of the distillation advantage", HONOURED,
                            gt=0, finite=True, note="the weight of log q(y_t) - log pi(y_t) in the advantage")
    ignore_memory_estimate: bool = F(False, "posttrain: on a CPU, run even when the plan's memory estimate is more "
                                            "than twice this machine's memory (refused otherwise; above 1x: a "
                                            "warning)", HONOURED)


class SamplingConfig(Section):
    logprobs: int = F(1, "per-token log-probs returned (top-k)", LOGPROBS, ge=0)
    max_tokens: int = F(128, "new tokens per response", HONOURED, ge=1)
    top_p: float = F(1.0, "nucleus sampling", HONOURED, gt=0, le=1)
    top_k: int = F(50, "top-k (-1 off)", HONOURED, ge=-1, note="-1: off")
    min_p: float = F(0.0, "min-p", HONOURED, ge=0, le=1)
    temperature: float = F(0.2, "temperature (0: greedy)", HONOURED, ge=0, finite=True, note="0: greedy")
    detokenize: bool = F(False, "return text as well as token ids", DETOKENIZE)
    seed: Opt[int] = F(None, "sampling seed", HONOURED)


class GenerateConfig(Section):
    limit_mm_image_per_prompt: int = F(1, "multimodal: the most images a training prompt may hold (more: a "
                                                 "DataError naming the prompt)", HONOURED, ge=0,
                                       note="images per prompt")
    limit_mm_video_per_prompt: int = F(0, "multimodal: the most videos a training prompt may hold (Qwen2.5-VL, Qwen3-VL; "
                                             "more: a DataError naming the prompt)", HONOURED, ge=0,
                                       note="videos per prompt")
    data_parallel_size: Opt[int] = F(None, "rollout data parallel size", COMPUTED)
    tokenizer_name_or_path: str = F("/path/to/tokenizer", "rollout tokenizer", GEN_TOKENIZER)
    trust_remote_code: bool = F(False, "HF trust_remote_code", REMOTE_CODE)
    eplb_token_collects: bool = F(False, "EPLB: collect per-expert token counts", EPLB)
    eplb_token_save_path: str = F("./", "EPLB: where the counts go", EPLB_PATH)
    expert_map_path: Opt[str] = F(None, "EPLB: expert placement map", EPLB_SET)
    infer_tensor_parallel_size: int = F(8, "rollout tensor parallel size", ROLLOUT_PARALLEL, ge=1)
    infer_pipeline_parallel_size: int = F(1, "rollout pipeline parallel size (must be 1)", ROLLOUT_PP, ge=1)
    infer_expert_parallel_size: int = F(1, "rollout expert parallel size", ROLLOUT_EP_SIZE, ge=1)
    max_num_seqs: int = F(1, "sequences decoded at once", HONOURED, ge=1)
    max_model_len: int = F(2048, "must be >= actor seq_length", HONOURED, ge=1)
    max_num_batched_tokens: int = F(2048, "token budget of one batch", HONOURED, ge=1)
    dtype: ROLLOUT_DTYPES = F("bfloat16", "bfloat16 or float32 (float32 only on CPU; the seed requires bfloat16); "
                                          "a CPU without AMX/AVX512-BF16 samples in float32", HONOURED)
    gpu_memory_utilization: float = F(0.5, "vLLM memory fraction", VLLM_ONLY, gt=0, le=1)
    offload_train_optimizer: bool = F(False, "the actor's (and PPO critic's) optimizer state on the host between "
                                             "updates", OFFLOAD)
    offload_train_grad: bool = F(False, "the actor's (and PPO critic's) gradients freed between updates (on a CPU "
                                        "too, the memory handed back to the system; a synchronous on-policy run of "
                                        "the HF backend frees them after each update without it)", HONOURED)
    offload_train_param: bool = F(False, "the actor's weights on the host during rollout, back for the update (where "
                                         "the rollout samples from a copy: vLLM, the native engine's bf16 copy)",
                                  OFFLOAD_PARAM)
    enable_prefix_caching: bool = F(False, "prefix caching across requests", PREFIX_CACHING)
    num_scheduler_steps: int = F(1, "vLLM multi-step scheduling", VLLM_ONLY, ge=1)
    enforce_eager: bool = F(True, "false: graph mode (the native engine: a static KV cache replayed as CUDA graphs; "
                                  "vLLM: its CUDA graphs)", EAGER)
    torchair_graph: bool = F(False, "Ascend torchair graph mode", VLLM_ASCEND)
    enable_expert_parallel: bool = F(False, "vLLM expert parallelism", ROLLOUT_EP)
    ascend_scheduler_config_enabled: bool = F(True, "Ascend scheduler", VLLM_ASCEND)
    num_speculative_tokens: int = F(0, "posttrain: n-gram speculative decoding on the native engine, up to this many "
                                       "draft tokens a row (0: off) from the row's sibling samples and prompt; exact "
                                       "(the same tokens as without it); pays only on long, repetitive answers "
                                       "(docs/rollout.md)", HONOURED, ge=0, note="0: off")
    sampling_config: SamplingConfig = F(SamplingConfig(), "sampling parameters (replaced wholesale)", HONOURED)


PROFILER_STAGES = ("actor_generate", "actor_compute_log_prob", "reference_compute_log_prob", "critic_compute_values",
                   "actor_update", "critic_update")  # posttrain.metrics.profiler.STAGES


class ProfilerConfig(Section):
    profile: bool = F(False, "profile iterations profile_step_start..end with torch.profiler (one process)", PROFILER)
    mstx: bool = F(False, "phase ranges: record_function in every trace; NVTX ranges too on CUDA", PROFILER)
    stage: Any = F("all", "all (whole iterations) or a list of the seed's stages (only those phases)", PROFILER_KEY)
    profile_save_path: str = F("", "trace directory (default <run dir>/profile)", PROFILER_KEY)
    profile_export_type: str = F("text", "text: Chrome/Perfetto JSON traces (db, Ascend's database, is refused)",
                                 PROFILER_KEY)
    profile_level: str = F("level0", "level_none, level0, level1, level2", PROFILER_KEY)
    profile_with_memory: bool = F(False, "record memory", PROFILER_KEY)
    profile_record_shapes: bool = F(False, "record shapes", PROFILER_KEY)
    profile_with_cpu: bool = F(True, "CPU activities", PROFILER_KEY)
    profile_with_npu: bool = F(True, "device (NPU) activities", PROFILER_KEY)
    profile_with_module: bool = F(False, "module stacks", PROFILER_KEY)
    profile_step_start: int = F(1, "first profiled iteration", PROFILER_KEY)
    profile_step_end: int = F(2, "end iteration (exclusive)", PROFILER_KEY)
    profile_analysis: bool = F(False, "online analysis", PROFILER_KEY)
    profile_ranks: Any = F("all", "ranks to profile", PROFILER_KEY)

    @model_validator(mode="after")
    def _check(self) -> "ProfilerConfig":
        if self.profile_level not in ("level_none", "level0", "level1", "level2"):
            raise ValueError(f"profiler_level only supports level0, 1, 2, and level_none, but gets {self.profile_level}")
        if self.profile_export_type not in ("text", "db"):
            raise ValueError(f"profile_export_type only supports text or db, but gets {self.profile_export_type}")
        if self.profile and self.profile_export_type == "db":
            raise ValueError("profile_export_type: db is the Ascend profiler's database format; set text (Chrome/"
                             "Perfetto JSON traces, which Perfetto, chrome://tracing and TensorBoard open)")
        stages = [self.stage] if isinstance(self.stage, str) else list(self.stage or [])
        unknown = [s for s in stages if s != "all" and s not in PROFILER_STAGES]
        if self.profile and unknown:
            raise ValueError(f"stage {unknown}: not a stage of the seed's profiler; use all or some of "
                             f"{', '.join(PROFILER_STAGES)}")
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"profile_step_end={self.profile_step_end} must be greater than profile_step_start="
                             f"{self.profile_step_start} (the end is exclusive)")
        return self


class MsprobeConfig(Section):
    msprobe: bool = F(False, "accuracy dumps: per-tensor statistics per iteration (posttrain.metrics.dumps; compare "
                             "two runs with posttrain compare-dumps)", MSPROBE)
    dump_path: str = F("./msprobe_dump", "dump directory: step_<i>/rank_<r>/<role>.jsonl, configurations.json",
                       MSPROBE_KEY)
    key_data_dump: bool = F(False, "statistics of the experience (prompts, responses, scores, log-probs, advantages, "
                                   "values), the loss inputs and outputs, the update metrics and the gradients",
                            MSPROBE_KEY)
    configurations_dump: bool = F(False, "write the resolved config to configurations.json", MSPROBE_KEY)
    actor_train_dump: bool = F(False, "module input/output statistics of the actor's old log-prob pass and update",
                               MSPROBE_KEY)
    actor_infer_dump: bool = F(False, "module input/output statistics of the rollout's model calls "
                                      "token_range_start..token_range_end", MSPROBE_KEY)
    reference_dump: bool = F(False, "module input/output statistics of the reference's pass", MSPROBE_KEY)
    critic_train_dump: bool = F(False, "module input/output statistics of the critic's value pass and update",
                                MSPROBE_KEY)
    token_range_start: int = F(0, "first dumped rollout model call (0: the prefill, then one per decoded token)",
                               MSPROBE_KEY, ge=0, note="a rollout model call, from 0")
    token_range_end: int = F(0, "last dumped rollout model call (inclusive)", MSPROBE_KEY, ge=0,
                             note="a rollout model call, from 0")
    step_start: int = F(0, "first dumped iteration (step_start and step_end both 0: every iteration)", MSPROBE_KEY,
                        ge=0, note="an iteration, from 1; 0 with step_end 0: every iteration")
    step_end: int = F(0, "last dumped iteration (inclusive)", MSPROBE_KEY, ge=0, note="an iteration, inclusive")

    @model_validator(mode="after")
    def _check(self) -> "MsprobeConfig":
        if self.msprobe and self.token_range_end < self.token_range_start:
            raise ValueError(f"token_range_end={self.token_range_end} must be >= token_range_start="
                             f"{self.token_range_start} (the range is inclusive)")
        if self.msprobe and self.step_end < self.step_start:
            raise ValueError(f"step_end={self.step_end} must be >= step_start={self.step_start} (the range is "
                             f"inclusive; both 0 dumps every iteration)")
        if self.msprobe and not self.dump_path:
            raise ValueError("dump_path is empty; give the folder the dumps go to")
        return self
