"""Prompts in: tokenizer and tiny-model builders, synthetic tasks, dataset loading, the curriculum sampler."""
