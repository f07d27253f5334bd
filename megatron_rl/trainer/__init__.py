"""The Megatron-Core trainer (SCALERL.md §2-3): model building, fp32 log-probs, the RL train step, checkpoints.

Heavy imports (torch, megatron.core) happen inside these modules; importing the package costs nothing.
"""
