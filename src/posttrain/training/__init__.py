"""The training engine (what runs forward/backward passes and optimizer steps; the loops that
drive it are :mod:`posttrain.loops`).

Modules: ``layout`` (the batch layout and its builder), ``forward`` (response log-probs/values),
``remove_padding`` (the packed forward), ``dynamic_batch`` (token-budget micro-batches),
``engine`` (TrainEngine, NaNLossError), ``loss_fns`` (actor/critic/SFT/DPO loss functions for
``TrainEngine.update``), ``optim`` (AdamW, Megatron-style LR schedule), ``parallel`` (data-parallel
reductions). Import the module you need; this package imports nothing eagerly.
"""
