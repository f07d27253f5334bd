"""Losses against hand numbers and a nested-loop reference, gradients included.

The reference walks prompts -> completions -> tokens in Python and builds the objective J of
docs/recipe.md §2 directly from its formula; the library computes it on flat tensors with aggregation
weights. Gradients are taken through a small linear softmax policy so they are checked with respect to
real parameters, not only to the log-probs.
"""

import math

import pytest
import torch

from megatron_rl.algo.aggregation import sequence_weights
from megatron_rl.algo.losses import policy_loss, token_terms
from megatron_rl.config import AlgoConfig

VOCAB, DIM = 11, 5


def _policy(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(DIM, VOCAB, generator=gen, dtype=torch.float64, requires_grad=True)
    return weight, gen


def _batch(gen, lengths, prompts):
    """Per-token features, sampled tokens, generator log-probs (perturbed), masks, advantages."""
    n = sum(lengths)
    feats = torch.randn(n, DIM, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (n,), generator=gen)
    gen_shift = 0.8 * torch.randn(n, generator=gen, dtype=torch.float64)  # large enough that some ratios clip
    mask = torch.rand(n, generator=gen) > 0.2
    seq_adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return feats, tokens, gen_shift, mask, seq_adv, seq_index


def _logprobs(weight, feats, tokens):
    return torch.log_softmax(feats @ weight, dim=-1).gather(1, tokens[:, None])[:, 0]


def _reference_objective(cfg, weight, feats, tokens, gen_shift, mask, seq_adv, lengths, prompts):
    """J from its formula, with explicit loops (maximised; the library minimises -J)."""
    lp_all = _logprobs(weight, feats, tokens)
    gen_lp = (lp_all.detach() + gen_shift).tolist()
    starts = [sum(lengths[:s]) for s in range(len(lengths))]
    per_seq = []  # (prompt, [token objectives])
    for s, (start, n) in enumerate(zip(starts, lengths, strict=False)):
        A = float(seq_adv[s])
        toks = [start + t for t in range(n) if bool(mask[start + t])]
        # tis_cap: the loss's ratio is to the trainer's own detached log-prob, the token weighted by min(rho, C)
        behaviour = [lp_all[t].detach().item() if cfg.tis_cap else gen_lp[t] for t in range(len(gen_lp))]
        tis = {t: min(math.exp(lp_all[t].item() - gen_lp[t]), cfg.tis_cap or math.inf) for t in toks}
        weight = {t: tis[t] if cfg.tis_cap else 1.0 for t in toks}
        if cfg.mismatch_mask and toks:  # the sequence's geometric-mean ratio to the generator, out of bounds
            geo = math.exp(sum(lp_all[t].item() - gen_lp[t] for t in toks) / len(toks))
            if not 1 / cfg.mismatch_mask <= geo <= cfg.mismatch_mask:
                weight = dict.fromkeys(toks, 0.0)  # out of the loss; the aggregation still counts its tokens
        if cfg.loss == "gspo":
            mean_lr = sum(lp_all[t] - behaviour[t] for t in toks) / max(len(toks), 1)
            s_i = torch.exp(mean_lr) if toks else torch.tensor(1.0, dtype=torch.float64)
            clipped = torch.clamp(s_i, 1 - cfg.eps_low, 1 + cfg.eps_high)
            obj = torch.minimum(s_i * A, clipped * A)
            per_seq.append((prompts[s], [weight[t] * obj for t in toks]))
            continue
        objs = []
        for t in toks:
            rho = torch.exp(lp_all[t] - behaviour[t])
            if cfg.loss == "cispo":
                objs.append(weight[t] * min(rho.detach().item(), cfg.eps_max) * A * lp_all[t])
            else:
                objs.append(weight[t] * torch.minimum(rho * A, torch.clamp(rho, 1 - cfg.eps_low, 1 + cfg.eps_high) * A))
        per_seq.append((prompts[s], objs))
    by_prompt = {}
    for p, objs in per_seq:
        by_prompt.setdefault(p, []).append(objs)
    if cfg.aggregation == "token":
        all_objs = [o for _, objs in per_seq for o in objs]
        return sum(all_objs) / len(all_objs)
    prompt_terms = []
    for seqs in by_prompt.values():
        if cfg.aggregation == "prompt":
            flat = [o for objs in seqs for o in objs]
            prompt_terms.append(sum(flat) / len(flat))
        else:
            prompt_terms.append(sum(sum(objs) / len(objs) for objs in seqs if objs) / len(seqs))
    return sum(prompt_terms) / len(prompt_terms)


def _library_loss(cfg, weight, feats, tokens, gen_shift, mask, seq_adv, seq_index, lengths, prompts):
    lp = _logprobs(weight, feats, tokens)
    gen_lp = lp.detach() + gen_shift
    loss_tokens = torch.zeros(len(lengths), dtype=torch.long).index_add(0, seq_index, mask.long())
    w_S = sequence_weights(loss_tokens, torch.tensor(prompts), cfg.aggregation).double()
    return policy_loss(cfg, lp, gen_lp, seq_adv[seq_index], mask, seq_index, len(lengths), w_S[seq_index])


LENGTHS = [3, 6, 2, 9, 4, 5]
PROMPTS = [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("loss", ["cispo", "gspo", "dapo", "grpo"])
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
@pytest.mark.parametrize(
    "correction",
    [{}, {"tis_cap": 1.3}, {"mismatch_mask": 1.2}, {"tis_cap": 2.0, "mismatch_mask": 1.3}],
    ids=["plain", "tis", "seq_mask", "tis_and_mask"],
)
def test_loss_and_gradient_match_the_loop_reference(loss, aggregation, correction):
    cfg = AlgoConfig(loss=loss, aggregation=aggregation, eps_max=1.5, **correction)
    if loss == "gspo":  # widen so both branches occur at these random ratios
        cfg.eps_low, cfg.eps_high = 0.1, 0.1
    weight, gen = _policy(1)
    feats, tokens, gen_shift, mask, seq_adv, seq_index = _batch(gen, LENGTHS, PROMPTS)

    loss_value, stats = _library_loss(cfg, weight, feats, tokens, gen_shift, mask, seq_adv, seq_index, LENGTHS, PROMPTS)
    if "mismatch_mask" in correction:  # both kept and masked sequences at these ratios
        assert 0 < float(stats["masked_seqs"]) < len(LENGTHS), float(stats["masked_seqs"])
    (grad_lib,) = torch.autograd.grad(loss_value, weight)
    ref = -_reference_objective(cfg, weight, feats, tokens, gen_shift, mask, seq_adv, LENGTHS, PROMPTS)
    (grad_ref,) = torch.autograd.grad(ref, weight)

    assert float(loss_value) == pytest.approx(float(ref), rel=1e-6, abs=1e-9)
    assert torch.allclose(grad_lib, grad_ref, rtol=1e-5, atol=1e-8)


def test_cispo_gradient_per_token_is_truncated_ratio_times_advantage_times_grad_logprob():
    cfg = AlgoConfig(loss="cispo", eps_max=1.2)
    weight, gen = _policy(2)
    feats, tokens, gen_shift, mask, seq_adv, seq_index = _batch(gen, [8], [0])
    lp = _logprobs(weight, feats, tokens)
    gen_lp = lp.detach() + gen_shift
    adv = seq_adv[seq_index]
    for t in range(8):
        one_hot = torch.zeros(8, dtype=torch.float64)
        one_hot[t] = 1.0  # a weight on token t only isolates its gradient
        loss, _ = policy_loss(cfg, lp, gen_lp, adv, mask, seq_index, 1, one_hot)
        (g_loss,) = torch.autograd.grad(loss, weight, retain_graph=True)
        (g_logp,) = torch.autograd.grad(lp[t], weight, retain_graph=True)
        rho = math.exp(float(lp[t] - gen_lp[t]))
        expected = -min(rho, 1.2) * float(adv[t]) * g_logp if mask[t] else torch.zeros_like(g_logp)
        assert torch.allclose(g_loss, expected, atol=1e-12)


def test_cispo_truncation_hand_numbers():
    cfg = AlgoConfig(loss="cispo", eps_max=5.0)
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    gen = torch.tensor([-1.0, -4.0, -0.5 + math.log(2.0)])  # ratios 1, e^2 = 7.39 (truncated), 0.5
    terms = token_terms(
        cfg,
        lp,
        gen,
        torch.tensor([1.0, 1.0, -2.0]),
        torch.ones(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.long),
        1,
    )
    assert torch.allclose(terms.loss_T, torch.tensor([1.0, 10.0, -0.5]), atol=1e-6)  # -min(rho,5)*A*logp
    assert terms.clipped_T.tolist() == [False, True, False]
    terms.loss_T.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([-1.0, -5.0, 1.0]), atol=1e-6)  # -sg(min(rho,5))*A


def test_dapo_clip_hand_numbers():
    cfg = AlgoConfig(loss="dapo")  # 0.2 / 0.28
    lp = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.1])).requires_grad_()
    gen = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    terms = token_terms(cfg, lp, gen, adv, torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long), 1)
    # rho 1.5, A+ -> clipped at 1.28; rho .5, A- -> clipped at .8 (obj -.8); rho .5, A+ -> .5; rho 1.1, A- -> -1.1
    assert torch.allclose(terms.loss_T, torch.tensor([-1.28, 0.8, -0.5, 1.1]), atol=1e-6)
    assert terms.clipped_T.tolist() == [True, True, False, False]
    terms.loss_T.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([0.0, 0.0, -0.5, 1.1]), atol=1e-6)  # d(-rho A)/dlogp = -rho A


def test_gspo_sequence_ratio_is_length_normalised():
    cfg = AlgoConfig(loss="gspo", eps_low=0.5, eps_high=0.5)
    # Every token of both sequences has log-ratio 0.1: s = e^0.1 for the 2-token and the 6-token sequence
    # alike (an unnormalised product would give e^0.2 and e^0.6).
    seq_index = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    lp = torch.full((8,), -1.0, requires_grad=True)
    gen = torch.full((8,), -1.1)
    terms = token_terms(cfg, lp, gen, torch.ones(8), torch.ones(8, dtype=torch.bool), seq_index, 2)
    assert torch.allclose(terms.loss_T, torch.full((8,), -math.exp(0.1)), atol=1e-6)
    # Masked tokens do not enter the sequence ratio.
    mask = torch.tensor([True, False, True, True, True, True, True, True])
    gen2 = gen.clone()
    gen2[1] = -50.0
    terms2 = token_terms(cfg, lp, gen2, torch.ones(8), mask, seq_index, 2)
    assert torch.allclose(terms2.loss_T[0], torch.tensor(-math.exp(0.1)), atol=1e-6) and terms2.loss_T[1] == 0


def test_masked_tokens_contribute_nothing():
    cfg = AlgoConfig(loss="cispo")
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, metrics = policy_loss(
        cfg,
        lp,
        torch.tensor([-1.0, -9.0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([True, False]),
        torch.zeros(2, dtype=torch.long),
        1,
        torch.ones(2),
    )
    loss.backward()
    assert lp.grad[1] == 0 and float(loss) == pytest.approx(1.0)
    assert metrics["loss_tokens"] == 1 and metrics["clipped_tokens"] == 0 and metrics["abs_logratio_sum"] == 0


def test_mismatch_kl_is_the_k3_estimate_on_loss_tokens():
    """KL(pi_gen || pi_train) estimated from generator samples: sum of rho - 1 - log rho over loss tokens."""
    lp = torch.tensor([-1.0, -2.0, -0.3, -4.0])
    gen = torch.tensor([-1.5, -1.0, -0.3, -1.0])
    mask = torch.tensor([True, True, True, False])
    _, metrics = policy_loss(
        AlgoConfig(), lp, gen, torch.ones(4), mask, torch.zeros(4, dtype=torch.long), 1, torch.ones(4)
    )
    expected = sum(math.exp(d) - 1 - d for d in (0.5, -1.0, 0.0))
    assert float(metrics["kl_sum"]) == pytest.approx(expected, rel=1e-12)


def test_tis_hand_numbers():
    """tis_cap=2: every token's gradient is -min(rho, 2) * A * grad log pi, for a PPO-clip loss too (its ratio
    to the trainer's own log-prob is 1: no clipping)."""
    lp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    gen = torch.tensor([-1.0 - math.log(3.0), -1.0 + math.log(2.0), -1.0])  # rho 3 (truncated at 2), 0.5, 1
    adv = torch.tensor([1.0, -1.0, 2.0])
    cfg = AlgoConfig(loss="dapo", tis_cap=2.0)
    terms = token_terms(cfg, lp, gen, adv, torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long), 1)
    assert terms.clipped_T.tolist() == [True, False, False]
    terms.loss_T.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([-2.0, 0.5, -2.0]), atol=1e-6)


def test_metrics_count_clipped_tokens_and_mismatch():
    cfg = AlgoConfig(loss="cispo", eps_max=2.0)
    lp = torch.tensor([0.0, 0.0, 0.0])
    gen = torch.tensor([-1.0, 0.5, 0.0])  # ratios e (truncated), e^-0.5, 1
    _, m = policy_loss(
        cfg,
        lp,
        gen,
        torch.ones(3),
        torch.ones(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.long),
        1,
        torch.ones(3) / 3,
    )
    assert m["clipped_tokens"] == 1 and float(m["abs_logratio_sum"]) == pytest.approx(1.5)
