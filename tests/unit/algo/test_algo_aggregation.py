"""Aggregation weights: each mode against an explicit nested-loop loss."""

import pytest
import torch

from megatron_rl.algo.aggregation import sequence_weights

# Prompt 7 has two short completions, prompt 3 has two long ones (one of them empty of loss tokens for
# the zero-length case below is tested separately).
LENGTHS = [2, 3, 10, 20]
PROMPTS = [7, 7, 3, 3]


def _loop_loss(terms_per_seq, prompts, mode):
    """terms_per_seq[s] is the list of per-token terms of sequence s."""
    groups = {}
    for s, p in enumerate(prompts):
        groups.setdefault(p, []).append(s)
    if mode == "token":
        tokens = [t for seq in terms_per_seq for t in seq]
        return sum(tokens) / len(tokens)
    per_prompt = []
    for seqs in groups.values():
        if mode == "prompt":
            tokens = [t for s in seqs for t in terms_per_seq[s]]
            per_prompt.append(sum(tokens) / len(tokens))
        else:
            per_prompt.append(sum(sum(terms_per_seq[s]) / len(terms_per_seq[s]) for s in seqs) / len(seqs))
    return sum(per_prompt) / len(per_prompt)


@pytest.mark.parametrize("mode", ["prompt", "sample", "token"])
def test_weights_reproduce_the_loop_loss(mode):
    gen = torch.Generator().manual_seed(0)
    terms = [torch.randn(n, generator=gen, dtype=torch.float64).tolist() for n in LENGTHS]
    w = sequence_weights(torch.tensor(LENGTHS), torch.tensor(PROMPTS), mode).double()
    got = sum(float(w[s]) * sum(terms[s]) for s in range(len(LENGTHS)))
    assert got == pytest.approx(_loop_loss(terms, PROMPTS, mode), rel=1e-6)


def test_prompt_aggregation_weighs_each_prompt_equally_whatever_the_lengths():
    # Term 1 on every token of prompt 7, 0 on prompt 3: the loss is exactly 1/2 although prompt 7 has 5 tokens
    # of 35 (token averaging would give 1/7).
    w = sequence_weights(torch.tensor(LENGTHS), torch.tensor(PROMPTS), "prompt")
    share_7 = float(w[0] * 2 + w[1] * 3)
    share_3 = float(w[2] * 10 + w[3] * 20)
    assert share_7 == pytest.approx(0.5) and share_3 == pytest.approx(0.5)
    token = sequence_weights(torch.tensor(LENGTHS), torch.tensor(PROMPTS), "token")
    assert float(token[0] * 2 + token[1] * 3) == pytest.approx(5 / 35)


def test_hand_computed_weights():
    lengths, prompts = torch.tensor(LENGTHS), torch.tensor(PROMPTS)
    assert torch.allclose(sequence_weights(lengths, prompts, "prompt"), torch.tensor([1 / 10, 1 / 10, 1 / 60, 1 / 60]))
    assert torch.allclose(sequence_weights(lengths, prompts, "sample"), torch.tensor([1 / 8, 1 / 12, 1 / 40, 1 / 80]))
    assert torch.allclose(sequence_weights(lengths, prompts, "token"), torch.full((4,), 1 / 35))


@pytest.mark.parametrize("mode", ["prompt", "sample", "token"])
def test_sequence_without_loss_tokens_gets_zero_weight(mode):
    w = sequence_weights(torch.tensor([0, 4, 4]), torch.tensor([0, 0, 1]), mode)
    assert w[0] == 0 and torch.isfinite(w).all()


def test_bad_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="algo.aggregation: 'mean'"):
        sequence_weights(torch.tensor([1]), torch.tensor([0]), "mean")
