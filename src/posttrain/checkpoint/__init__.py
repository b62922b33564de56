"""Save and resume training state in Megatron's directory layout, with an HF-loadable actor.

Layout (docs/checkpoints.md)::

    <save>/latest_checkpointed_iteration.txt     "5"
    <save>/iter_0000005/config.json, model.safetensors, tokenizer files   (HF actor)
                        optimizer.pt  scheduler.pt  rng.pt  sampler.pt  trainer_state.json
                        <name>/...                                         (extra parts: critic)

Saving is atomic: everything is written into a hidden temporary directory next to the target,
fsynced and renamed; then the tracker file is replaced atomically. A failed save raises
:class:`CheckpointError` and leaves the previous checkpoint and tracker untouched.

Resume semantics follow the seed (section 8.2): ``finetune`` loads weights only and restarts at
iteration 0; ``no_load_optim`` skips optimizer and scheduler; ``no_load_rng`` skips RNG states.
When to save (``save_interval``) is the training loop's decision, not this module's.

Modules: :mod:`~posttrain.checkpoint.files` (names, :class:`Part`, durable writes, RNG),
:mod:`~posttrain.checkpoint.save`, :mod:`~posttrain.checkpoint.verify` (listing, resolving,
checking), :mod:`~posttrain.checkpoint.load`. The names below are the public API.
"""

from posttrain.checkpoint.files import (STATE_FILE, TRACKER, CheckpointLoad, Part, iter_dir_name,
                                        make_readable, rng_state, set_rng_state)
from posttrain.checkpoint.load import load_adapter_weights, load_checkpoint, load_part, load_weights
from posttrain.checkpoint.save import prune_checkpoints, save_checkpoint, save_hf_weights
from posttrain.checkpoint.verify import (check_model_files, earlier_checkpoints, find_latest, is_hf_model_dir,
                                         list_checkpoints, read_trainer_state, resolve_checkpoint, verify_checkpoint)

__all__ = ["STATE_FILE", "TRACKER", "CheckpointLoad", "Part", "check_model_files",
           "earlier_checkpoints", "find_latest", "is_hf_model_dir", "iter_dir_name", "list_checkpoints",
           "load_adapter_weights", "load_checkpoint", "load_part", "load_weights", "make_readable",
           "prune_checkpoints", "read_trainer_state", "resolve_checkpoint", "rng_state", "save_checkpoint",
           "save_hf_weights", "set_rng_state", "verify_checkpoint"]
