"""Rollout routing replay for MoE policies on megatron-core's router hook (docs/recipe.md §9).

    replays = install(model, replay=True)        # one RolloutReplay per local MoE router (algo.routing_replay)
    set_targets(replays, micro_batch, sp_rank)   # before each micro-batch's forward: the generator's choices
    sums = agreement_sums(replays, ...)          # per layer: tokens whose expert set matched, tokens replayed

Why: the generator (SGLang) and the trainer (megatron-core) compute the router logits with different kernels,
so a token close to a top-k boundary can go to different experts on the two sides, and then its log-prob differs
by far more than numerics: the importance ratio no longer measures the policy change. With `rollout` replay
the trainer routes every token to the experts the generator chose for it (R3, "rollout routing replay"): the
gating weights are still the trainer's own scores at those experts, so the router keeps its gradient.

How: megatron-core's TopKRouter asks `router.router_replay.get_replay_topk(scores, topk, ...)` for its top-k
whenever `router_replay` is set (moe_utils.topk_routing_with_score_function). `RolloutReplay` subclasses
megatron's `RouterReplay` and keeps its protocol: the targets of each micro-batch are appended to
`replay_backward_list` when set; a forward routes by `target_topk_idx` (REPLAY_FORWARD); a recomputation inside
backward (activation recompute) pops the oldest targets (REPLAY_BACKWARD), which is the micro-batch being
back-propagated under both the plain and the 1F1B pipeline schedules. Which of the two applies is decided per
call by whether autograd is running a backward pass, so no schedule hook is needed. Targets stay in their
compact form on the host and reach the device one layer at a time, as int64 [local tokens, top-k].

Layouts: the router sees the tokens of its rank's sequence-parallel shard (rows [r*S/tp, (r+1)*S/tp) of the
packed row) or, without SP, the whole row; a pipeline stage holds only its own layers, found by their global
layer number. Tokens the generator never ran (each sequence's last token, padding, filler rows) carry the
placeholder experts 0..k-1 and are left out of the agreement: nothing is predicted from their outputs.

`measure` (no replay) routes as usual and only counts the agreement with the generator's choices. Every forward
counts it (not the recomputations), on device, read once per step, beside the share of the routed tokens whose
experts the router really took from the records (`replayed` of `offered`): 1.0 under `rollout` when every token
given targets was routed by them, 0.0 under `measure`, and below 1.0 if megatron ever routed a forward without
asking the hook. The agreement alone cannot tell a replayed step from an unreplayed one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _router_replay_base() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


class RolloutReplay(_router_replay_base()):  # type: ignore[misc]
    """One MoE layer's replay: megatron's RouterReplay state, the generator's records as targets."""

    def __init__(self, layer: int, replay: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # owned by its router, not megatron's global list
        self.layer = layer
        """Global 0-based layer index: the record's layer axis."""
        self.replay = replay
        self.valid_T: Tensor | None = None
        self.matched = torch.zeros((), dtype=torch.float64)
        self.counted = torch.zeros((), dtype=torch.float64)
        self.replayed = torch.zeros((), dtype=torch.float64)
        """Routed tokens whose experts were the targets (forwards only): `counted` under rollout, 0 under measure."""
        self.offered = 0
        """Routed tokens given targets by `set_targets` (forwards only), whether or not the router then asked."""

    def set_targets(self, target_TK: Tensor, valid_T: Tensor) -> None:
        self.set_target_indices(target_TK)
        self.valid_T = valid_T
        self.offered += int(valid_T.sum())

    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        assert default_compute_topk is not None
        recomputing = torch._C._current_graph_task_id() != -1  # inside a backward pass: activation recompute
        if recomputing:
            self.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
            target = self.replay_backward_list.pop(0)
            if not self.replay:
                return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        else:
            self.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            target = self.target_topk_idx
            if target is None:
                raise RuntimeError(f"routing replay: layer {self.layer} has no routing targets for this forward")
        target = target.to(scores.device, non_blocking=True).long()
        if target.shape != (scores.shape[0], topk):
            raise ValueError(
                f"routing replay: layer {self.layer} got targets of shape {list(target.shape)} for "
                f"{scores.shape[0]} tokens x top-{topk}"
            )
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if not recomputing:
            self._count(own, target)
        if not self.replay:
            return probs, own
        return scores.gather(1, target), target

    @torch.no_grad()
    def _count(self, own: Tensor, target: Tensor) -> None:
        assert self.valid_T is not None
        valid = self.valid_T.to(own.device, non_blocking=True)
        same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1) & valid
        self.matched = self.matched.to(own.device) + same.sum()
        self.counted = self.counted.to(own.device) + valid.sum()
        if self.replay:
            self.replayed = self.replayed.to(own.device) + valid.sum()

    def reset(self) -> None:
        self.clear_indices()
        self.valid_T = None
        self.matched = torch.zeros((), dtype=torch.float64, device=self.matched.device)
        self.counted = torch.zeros((), dtype=torch.float64, device=self.counted.device)
        self.replayed = torch.zeros((), dtype=torch.float64, device=self.replayed.device)
        self.offered = 0


def install(model: Any, replay: bool) -> list[RolloutReplay]:
    """A RolloutReplay on every MoE router of this model chunk (pipeline stage), by global layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            if module.config.moe_router_fusion:
                raise ValueError(
                    "algo.routing_replay: megatron-core's fused router (moe_router_fusion) computes its top-k in "
                    "one kernel that never asks the replay"
                )
            module.router_replay = RolloutReplay(module.layer_number - 1, replay)
            replays.append(module.router_replay)
    return replays  # empty on a pipeline stage of dense layers only (a dense model is refused by the config)


def set_targets(replays: list[RolloutReplay], routing_TLK: Tensor, valid_T: Tensor, shard: tuple[int, int]) -> None:
    """Give each layer its targets for the next forward: `routing_TLK` [row tokens, layers, top-k] and `valid_T`
    of the whole packed row, cut to this rank's sequence-parallel shard (`shard` = (rank, size); (0, 1) without
    sequence parallelism)."""
    rank, size = shard
    tokens = routing_TLK.shape[0] // size
    rows = slice(rank * tokens, (rank + 1) * tokens)
    for replay in replays:
        replay.set_targets(routing_TLK[rows, replay.layer], valid_T[rows])


def reset(replays: list[RolloutReplay]) -> None:
    for replay in replays:
        replay.reset()


def agreement_sums(replays: list[RolloutReplay], num_layers: int, device: torch.device) -> Tensor:
    """[4, num_layers] float64: matched, counted, replayed and offered tokens of this rank's layers (zeros
    elsewhere), to be summed over the ranks that see distinct tokens."""
    sums = torch.zeros(4, num_layers, dtype=torch.float64, device=device)
    for replay in replays:
        sums[0, replay.layer] += replay.matched.to(device)
        sums[1, replay.layer] += replay.counted.to(device)
        sums[2, replay.layer] += replay.replayed.to(device)
        sums[3, replay.layer] += replay.offered
    return sums
