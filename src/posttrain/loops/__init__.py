"""The training loops (on-policy GRPO/DAPO/PPO, offline SFT/DPO), the session they share, and
``train(plan)`` in :mod:`posttrain.loops.build`. The engine that runs forward/backward passes
and optimizer steps is :mod:`posttrain.training`."""
