"""The RL math of ScaleRL as pure torch functions: no Megatron, no Ray, no HTTP.

- advantages.py   group-centred rewards with batch / group / no normalisation
- aggregation.py  per-sequence token weights for prompt / sample / token averaging
- losses.py       CISPO, GSPO, DAPO and GRPO per-token objectives and their metrics
- filters.py      zero-variance groups and no-positive resampling (with checkpointable state)
- length_penalty.py  DAPO's overlong penalty (the `loo-lp` ablation)

Everything works on flat token tensors (suffix `_T`), per-sequence tensors (`_S`) or reward tables
(`_PG`: prompts x generations), so the trainer can pack sequences and split micro-batches freely.
"""
