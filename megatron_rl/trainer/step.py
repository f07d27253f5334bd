"""The RL train step on Megatron-Core (docs/recipe.md §2-3).

    trainer = Trainer(run_config)            # joins the process groups, builds model + optimizer
    metrics = trainer.train_step(groups)     # one optimizer step on a batch of groups; version += 1

One step:

    groups -> advantages (batch / group / none) and aggregation weights, computed over the WHOLE batch
           -> sequences sharded over data-parallel ranks, balanced by tokens
           -> packed into rows of <= trainer.micro_batch_tokens in THD layout (several sequences per row,
              megatron's PackedSeqParams with cu_seqlens: attention causal within each sequence, no mask;
              positions restarting per sequence; padded only to what sequence parallel needs)
           -> megatron's forward/backward schedule (any TP/PP/EP); the last stage computes fp32 log-probs
              of the completion tokens only (logprobs.py) and the configured loss (megatron_rl.algo)
           -> gradients summed over micro-batches and data-parallel ranks (the weights already
              aggregate: per-token-loss mode, no 1/num_microbatches, no 1/dp)
           -> a non-finite loss or gradient skips the step (counted in train/skipped_steps)
           -> LR warm-up then constant, AdamW (eps 1e-15) with clipping, megatron's (distributed) optimizer

Every rank of the trainer calls `train_step` with the same batch (the driver broadcasts it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.algo.advantages import group_advantages
from megatron_rl.algo.aggregation import sequence_weights
from megatron_rl.algo.losses import policy_loss
from megatron_rl.config import RunConfig
from megatron_rl.rollout.types import Group, RoutingShape
from megatron_rl.trainer import cpu_compat
from megatron_rl.trainer.distributed import RankInfo, init_distributed
from megatron_rl.trainer.logprobs import token_logprobs
from megatron_rl.trainer.model import build_model, output_weight
from megatron_rl.trainer.optimizer import build_optimizer

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}
"""Dense bf16 peak FLOP/s per device, by device name, for MFU."""


@dataclass
class Sequence:
    """One completion as the trainer sees it: prompt + completion tokens and per-completion-token data."""

    tokens: list[int]
    num_prompt: int
    gen_logprobs: list[float]
    loss_mask: list[bool]
    advantage: float
    weight: float
    """The aggregation weight of each of its loss tokens (aggregation.py)."""
    index: int = 0
    """Position in the batch (to return per-sequence results in order)."""
    routing: np.ndarray | None = None
    """The generator's experts for all tokens but the last, [len(tokens) - 1, layers, top-k] (routing replay)."""

    @property
    def num_completion(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass
class MicroBatch:
    """One packed row in THD layout: sequences back to back, described by `cu_seqlens`, no attention mask.

    Positions restart at 0 for every sequence. The row is padded to a multiple of `pad_multiple` (sequence
    parallel splits it over the TP ranks) with a padding segment of its own: it attends only to itself,
    predicts nothing and is not in the loss. With context parallelism (`cp` > 1) every sequence is first padded
    to a multiple of `seq_pad_multiple` (2 x cp: its own trailing tokens, after everything real, so causal
    attention keeps them out of every real token's view) and this rank (`cp_rank`) holds its share of every
    segment (trainer/context_parallel.py); the head computes the log-probs of the completion tokens it holds and
    gathers the rest from the CP group.
    """

    sequences: list[Sequence]
    pad_multiple: int = 1
    chunk_size: int | None = None
    """Llama-4 chunked attention: cut the RoPE layers' attention every `chunk_size` tokens of a sequence."""
    routing_shape: RoutingShape | None = None
    """Routing replay: build `routing_TLK` and `routing_valid_T` from the sequences' records (this rank's tokens)."""
    seq_pad_multiple: int = 1
    cp: int = 1
    cp_rank: int = 0
    input_ids: Tensor = field(init=False)
    """[1, tokens this rank holds]."""
    position_ids: Tensor = field(init=False)
    lengths: list[int] = field(init=False)
    """Segment lengths of the whole row: the sequences (each padded), then the row's padding (if any)."""
    row_tokens: int = field(init=False)
    """Tokens of the whole row, padding included (on all CP ranks together)."""
    hidden_index_T: Tensor = field(init=False)
    """Row position of the hidden state that predicts each completion token (the whole row's)."""
    targets_T: Tensor = field(init=False)
    seq_index_T: Tensor = field(init=False)
    head_index_T: Tensor = field(init=False)
    """Rows of this rank's hidden states that predict the completion tokens it holds (all of them without CP)."""
    head_targets_T: Tensor = field(init=False)
    cp_counts: list[int] = field(init=False)
    """Completion tokens each CP rank predicts."""
    cp_order: Tensor = field(init=False)
    """The completion tokens (indices into targets_T) predicted by CP rank 0, then rank 1, ..."""
    cp_index: Tensor = field(init=False)
    """Row positions of this rank's tokens, in its order."""
    cp_split: Any = field(init=False, default=None)
    """The row's context-parallel layout on this rank (trainer/context_parallel.py), None without CP."""

    def __post_init__(self) -> None:
        if self.pad_multiple % self.seq_pad_multiple:
            raise ValueError(f"pad_multiple {self.pad_multiple} is not a multiple of {self.seq_pad_multiple}")
        tokens, positions, hidden_index, targets, seq_index = [], [], [], [], []
        self.lengths = []
        for s, seq in enumerate(self.sequences):
            offset = len(tokens)
            length = -(-len(seq.tokens) // self.seq_pad_multiple) * self.seq_pad_multiple
            tokens += seq.tokens + [0] * (length - len(seq.tokens))
            positions += range(length)
            hidden_index += range(offset + seq.num_prompt - 1, offset + len(seq.tokens) - 1)
            targets += seq.tokens[seq.num_prompt :]
            seq_index += [s] * seq.num_completion
            self.lengths.append(length)
        padding = -len(tokens) % self.pad_multiple
        if padding:
            tokens += [0] * padding
            positions += range(padding)
            self.lengths.append(padding)
        self.row_tokens = len(tokens)
        self.hidden_index_T = torch.tensor(hidden_index, dtype=torch.long)
        self.targets_T = torch.tensor(targets, dtype=torch.long)
        self.seq_index_T = torch.tensor(seq_index, dtype=torch.long)
        self.input_ids, self.position_ids = torch.tensor([tokens]), torch.tensor([positions])
        self.head_index_T, self.head_targets_T = self.hidden_index_T, self.targets_T
        self.cp_counts, self.cp_order = [len(targets)], torch.arange(len(targets))
        self.cp_index = torch.arange(self.row_tokens)
        if self.cp > 1:
            self._split_for_context_parallel()
        if self.routing_shape is not None:
            self.routing_TLK, self.routing_valid_T = self._routing(self.routing_shape)

    def _split_for_context_parallel(self) -> None:
        """This rank's tokens, and which completion tokens each CP rank predicts (in its local order)."""
        from megatron_rl.trainer.context_parallel import cp_layout

        layout = self.cp_split = cp_layout(self.lengths, self.cp, self.cp_rank, self.chunk_size)
        self.cp_index = layout.index
        self.input_ids, self.position_ids = self.input_ids[:, layout.index], self.position_ids[:, layout.index]
        owner_R, local_R = layout.owner_and_local()
        owner_T, local_T = owner_R[self.hidden_index_T], local_R[self.hidden_index_T]
        per_rank = [torch.nonzero(owner_T == r).squeeze(1) for r in range(self.cp)]
        per_rank = [tokens[local_T[tokens].argsort()] for tokens in per_rank]  # each rank's local order
        mine = per_rank[self.cp_rank]
        self.head_index_T, self.head_targets_T = local_T[mine], self.targets_T[mine]
        self.cp_counts, self.cp_order = [len(t) for t in per_rank], torch.cat(per_rank)

    def _routing(self, shape: RoutingShape) -> tuple[Tensor, Tensor]:
        """The routing targets [tokens, layers, top-k] of this rank's tokens and which of them the generator really
        routed: each sequence's record, then placeholder experts 0..k-1 for its last token, the padding and filler
        rows."""
        routing = np.empty((self.row_tokens, shape.layers, shape.topk), dtype=shape.dtype)
        routing[:] = np.arange(shape.topk, dtype=shape.dtype)
        valid = np.zeros(self.row_tokens, dtype=bool)
        offset = 0
        for seq, length in zip(self.sequences, self.lengths, strict=False):
            if seq.routing is not None:
                routing[offset : offset + len(seq.routing)] = seq.routing
                valid[offset : offset + len(seq.routing)] = True
            offset += length
        routing_TLK, valid_T = torch.from_numpy(routing), torch.from_numpy(valid)
        if self.cp > 1:
            return routing_TLK[self.cp_index], valid_T[self.cp_index]
        return routing_TLK, valid_T

    @property
    def num_tokens(self) -> int:
        """Tokens this rank holds of the row, padding included (the whole row without CP)."""
        return int(self.input_ids.shape[1])

    def packed_seq_params(self, device: torch.device) -> Any:
        """megatron's PackedSeqParams (THD) for this row, on `device`."""
        from megatron_rl.trainer.attention import packed_rows

        return packed_rows(self.lengths, device, self.chunk_size, self.cp_split)

    def token_data(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per completion token: generator log-prob, advantage, loss mask, aggregation weight."""
        gen = torch.tensor([lp for seq in self.sequences for lp in seq.gen_logprobs], dtype=torch.float32)
        adv = torch.tensor([seq.advantage for seq in self.sequences for _ in range(seq.num_completion)])
        mask = torch.tensor([m for seq in self.sequences for m in seq.loss_mask], dtype=torch.bool)
        weight = torch.tensor([seq.weight for seq in self.sequences for _ in range(seq.num_completion)])
        return gen, adv.float(), mask, weight.float()


def sequences_from_groups(groups: list[Group], run: RunConfig) -> list[Sequence]:
    """Advantages and aggregation weights over the whole batch, one `Sequence` per completion."""
    empty = [g.prompt_id for g in groups if not g.completions]
    if empty:
        raise ValueError(f"train_step: groups without completions (prompts {empty})")
    advantages = group_advantages([g.rewards for g in groups], run.algo.advantage_norm, run.algo.advantage_eps)
    completions = [(p, c) for p, g in enumerate(groups) for c in g.completions]
    lengths_S = torch.tensor([sum(c.loss_mask) for _, c in completions])
    prompt_index_S = torch.tensor([p for p, _ in completions])
    weights_S = sequence_weights(lengths_S, prompt_index_S, run.algo.aggregation)
    advantages_S = [a for group in advantages for a in group]
    return [
        Sequence(
            tokens=list(c.prompt_tokens) + list(c.tokens),
            num_prompt=len(c.prompt_tokens),
            gen_logprobs=list(c.gen_logprobs),
            loss_mask=list(c.loss_mask),
            advantage=float(advantages_S[i]),
            weight=float(weights_S[i]),
            index=i,
            routing=c.routed_experts,
        )
        for i, (_, c) in enumerate(completions)
    ]


def shard_for_rank(sequences: list[Sequence], num_shards: int, shard: int) -> list[Sequence]:
    """This data-parallel rank's sequences: longest first onto the least-loaded shard (deterministic)."""
    loads = [0] * num_shards
    mine = []
    for seq in sorted(sequences, key=lambda s: (-len(s.tokens), s.index)):
        target = min(range(num_shards), key=lambda r: (loads[r], r))
        loads[target] += len(seq.tokens)
        if target == shard:
            mine.append(seq)
    return mine


def pack(
    sequences: list[Sequence], budget: int, pad_multiple: int = 1, seq_pad_multiple: int = 1
) -> list[list[Sequence]]:
    """First-fit decreasing into rows of <= budget tokens once each sequence is padded to a multiple of
    `seq_pad_multiple` and the row to a multiple of `pad_multiple` (a longer sequence gets a row of its own; the
    trainer refuses those before packing)."""
    rows: list[list[Sequence]] = []
    loads: list[int] = []
    for seq in sorted(sequences, key=lambda s: (-len(s.tokens), s.index)):
        length = -(-len(seq.tokens) // seq_pad_multiple) * seq_pad_multiple
        for r, load in enumerate(loads):
            if -(-(load + length) // pad_multiple) * pad_multiple <= budget:
                rows[r].append(seq)
                loads[r] += length
                break
        else:
            rows.append([seq])
            loads.append(length)
    return rows


def _filler() -> Sequence:
    """A two-token sequence with no loss tokens: keeps micro-batch counts equal across ranks."""
    return Sequence([0, 0], num_prompt=1, gen_logprobs=[0.0], loss_mask=[False], advantage=0.0, weight=0.0, index=-1)


def count_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


class StepSums:
    """What one train step sums over its micro-batches, by name, then over the trainer's ranks in one
    all-reduce together with the ranks' non-finite gradient counts (the vote that skips a step). The sums stay
    on the device until then: no host sync per micro-batch."""

    NAMES = ("loss", "loss_tokens", "clipped_tokens", "abs_logratio", "entropy", "kl", "masked_seqs")

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def add(self, **terms: Tensor) -> None:
        for name, value in terms.items():
            value = value.detach().double()
            self.values[name] = self.values[name] + value if name in self.values else value

    def reduce(self, counted: bool, nonfinite_grads: Tensor) -> dict[str, float]:
        """The sums over the ranks whose sums are `counted`, and `nonfinite_grads` summed over all ranks."""
        device = nonfinite_grads.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local = [self.values[name].to(device) if counted and name in self.values else zero for name in self.NAMES]
        stacked = torch.stack([*local, nonfinite_grads.double()])
        if dist.get_world_size() > 1:
            dist.all_reduce(stacked)
        return dict(zip((*self.NAMES, "nonfinite_grads"), stacked.tolist(), strict=True))


class Trainer:
    """One trainer rank: the model chunk, its optimizer, and the train step."""

    def __init__(self, run: RunConfig) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self.run = run
        self.info: RankInfo = init_distributed(
            run.parallel, run.trainer.seed, run.model.is_moe, timeout_s=run.collective_timeout_s
        )
        torch.manual_seed(run.trainer.seed)
        self.model = build_model(run.model, run.parallel, run.trainer)
        config = self.model.config
        self.ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                use_distributed_optimizer=run.parallel.distributed_optimizer,
                overlap_grad_reduce=False,
                bucket_size=None,
            ),
            module=self.model,
        )
        # Sum gradients over micro-batches and ranks exactly (the loss weights already aggregate).
        config.finalize_model_grads_func = lambda models, num_tokens=None, **kwargs: finalize_model_grads(
            models, None, **kwargs
        )
        self.optimizer = build_optimizer(run, self.ddp)
        cpu_compat.apply()
        self.routing_shape: RoutingShape | None = None
        self.replays: list[Any] = []
        if run.algo.routing_replay != "none":  # MoE routing replay: the generator's experts (routing.py)
            from megatron_rl.trainer import routing

            moe = run.model.moe
            assert moe.num_experts is not None
            self.routing_shape = RoutingShape(run.model.num_layers, moe.router_topk, moe.num_experts)
            self.replays = routing.install(self.model, replay=run.algo.routing_replay == "rollout")
        self.last_routing_agreement: dict[str, float] = {}
        """The routing agreement of the last compute_logprobs (routing replay)."""
        self.step = 0
        """Optimizer steps taken (successful ones): the policy version of the current weights."""
        self.skipped_steps = 0
        self.optimizer_has_state = False
        """Adam state exists only after a first step (checkpoint.py initialises it before save/load)."""
        self.num_params = self._global_param_count()

    # ------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.step

    def _global_param_count(self) -> int:
        from megatron.core import parallel_state

        local = torch.tensor([float(count_params(self.model))], dtype=torch.float64)
        if self.run.parallel.tp * self.run.parallel.pp > 1:
            dist.all_reduce(local, group=parallel_state.get_model_parallel_group())
        return int(local.item())

    def _learning_rate(self) -> float:
        opt = self.run.trainer.optimizer
        if opt.warmup_steps == 0:
            return opt.lr
        return opt.lr * min(1.0, (self.step + 1) / opt.warmup_steps)

    def _micro_batches(self, sequences: list[Sequence]) -> list[MicroBatch]:
        from megatron.core import parallel_state

        parallel = self.run.parallel
        budget, multiple = self.run.trainer.micro_batch_tokens, parallel.pad_multiple
        if self.routing_shape is not None:  # same batch on every rank: all raise here, before any collective
            for seq in sequences:
                what = f"algo.routing_replay={self.run.algo.routing_replay}: completion {seq.index} of the batch"
                if seq.routing is None:
                    raise ValueError(f"{what} has no routing record (the generator returned none)")
                self.routing_shape.check(seq.routing, len(seq.tokens) - 1, what)
            what = f"algo.routing_replay={self.run.algo.routing_replay}: the batch"
            self.routing_shape.check_captured([seq.routing for seq in sequences if seq.routing is not None], what)
        longest = max(sequences, key=lambda s: len(s.tokens))
        if parallel.padded_row([len(longest.tokens)]) > budget:  # same batch on every rank: all raise here
            raise ValueError(
                f"trainer.micro_batch_tokens: a sequence of {len(longest.tokens)} tokens (padded to "
                f"{parallel.padded_row([len(longest.tokens)])}) does not fit a micro-batch of {budget} tokens; raise "
                "trainer.micro_batch_tokens or lower the rollout's length budgets"
            )
        mine = shard_for_rank(
            sequences, parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        )
        rows = pack(mine, budget, multiple, parallel.seq_pad_multiple)
        count = torch.tensor([len(rows)])
        if dist.get_world_size() > 1:  # expert-parallel all-to-alls need the same count on every rank
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        rows += [[_filler()] for _ in range(int(count.item()) - len(rows))]
        chunk, cp = self.run.model.attention_chunk_size, parallel.cp
        return [
            MicroBatch(row, multiple, chunk, self.routing_shape, parallel.seq_pad_multiple, cp, self.info.cp_rank)
            for row in rows
        ]

    def _forward(self, model: Any, micro_batch: MicroBatch, record: dict[str, Any]) -> Tensor:
        from megatron.core import parallel_state, tensor_parallel

        def head(hidden_states: Tensor, **kwargs: Any) -> Tensor:
            if self.model.config.sequence_parallel:
                hidden_states = tensor_parallel.gather_from_sequence_parallel_region(hidden_states)
            else:
                hidden_states = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_states)
            hidden_TH = hidden_states[:, 0, :].index_select(0, micro_batch.head_index_T.to(hidden_states.device))
            if self.run.trainer.fp32_lm_head:
                hidden_TH = hidden_TH.float()
            logprobs_T, entropy_T = token_logprobs(
                hidden_TH,
                output_weight(self.model),
                micro_batch.head_targets_T.to(hidden_states.device),
                max(1, (self.run.trainer.logprob_chunk_mib << 20) // (4 * output_weight(self.model).shape[0])),
                parallel_state.get_tensor_model_parallel_group(),
            )
            if micro_batch.cp > 1:  # every CP rank computes the loss of the whole row from all its tokens
                from megatron_rl.trainer.context_parallel import gather_tokens

                group, counts = parallel_state.get_context_parallel_group(), micro_batch.cp_counts
                logprobs_T = gather_tokens(logprobs_T, counts, micro_batch.cp_order, group)
                entropy_T = gather_tokens(entropy_T, counts, micro_batch.cp_order, group)
            record["entropy"] = entropy_T
            return logprobs_T

        device = self.info.device
        if self.replays:
            from megatron_rl.trainer import routing

            sp = self.model.config.sequence_parallel
            shard = (parallel_state.get_tensor_model_parallel_rank(), self.run.parallel.tp) if sp else (0, 1)
            routing.set_targets(self.replays, micro_batch.routing_TLK, micro_batch.routing_valid_T, shard)
        return model(
            micro_batch.input_ids.to(device),
            micro_batch.position_ids.to(device),
            None,  # packed sequences carry their boundaries in packed_seq_params: no mask, causal per sequence
            packed_seq_params=micro_batch.packed_seq_params(device),
            output_processor=head,
        )

    def _run_schedule(self, micro_batches: list[MicroBatch], forward_only: bool, loss_fn: Any) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        records: list[dict[str, Any]] = []
        batches = iter(micro_batches)

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[Tensor, Any]:
            micro_batch = next(data_iterator)
            record: dict[str, Any] = {"micro_batch": micro_batch}
            records.append(record)
            output = self._forward(model, micro_batch, record)
            return output, lambda logprobs_T: loss_fn(logprobs_T, micro_batch, record)

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[self.ddp],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.num_tokens for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return records

    # ------------------------------------------------------------------------------------------
    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on `groups` (same batch on every trainer rank); returns train/* metrics."""
        started = time.perf_counter()
        sequences = sequences_from_groups(groups, self.run)
        micro_batches = self._micro_batches(sequences)
        algo = self.run.algo
        sums = StepSums()

        def loss_fn(logprobs_T: Tensor, micro_batch: MicroBatch, record: dict[str, Any]) -> tuple[Any, ...]:
            gen_T, adv_T, mask_T, weight_T = (t.to(logprobs_T.device) for t in micro_batch.token_data())
            loss, stats = policy_loss(
                algo,
                logprobs_T,
                gen_T,
                adv_T,
                mask_T,
                micro_batch.seq_index_T.to(logprobs_T.device),
                len(micro_batch.sequences),
                weight_T,
            )
            sums.add(
                loss=loss.detach(),
                loss_tokens=stats["loss_tokens"],
                clipped_tokens=stats["clipped_tokens"],
                abs_logratio=stats["abs_logratio_sum"],
                entropy=record["entropy"][mask_T].double().sum(),
                kl=stats["kl_sum"],
                masked_seqs=stats["masked_seqs"],
            )
            return loss, torch.tensor(int(mask_T.sum()), dtype=torch.int), {"loss": loss.detach()}

        for group in self.optimizer.param_groups:
            group["lr"] = self._learning_rate()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._reset_routing()
        self._run_schedule(micro_batches, forward_only=False, loss_fn=loss_fn)
        agreement = self._routing_agreement()

        # The loss and metric sums live on the last pipeline stage of each data-parallel rank (TP and CP rank 0
        # count them once); every rank votes on its own gradients. One all-reduce sums both over the trainer.
        from megatron.core import parallel_state

        counted = (
            parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
        )
        totals = sums.reduce(counted, nonfinite_grads=self._nonfinite_grads())
        loss_tokens = max(totals["loss_tokens"], 1.0)
        if math.isfinite(totals["loss"]) and totals["nonfinite_grads"] == 0:
            _, grad_norm, _ = self.optimizer.step()
            self.optimizer_has_state = True
            self.step += 1
            lr = self._last_lr()
        else:  # a non-finite loss or gradient on any rank: the step is skipped everywhere, and counted
            self.skipped_steps += 1
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            grad_norm, lr = float("nan"), self._learning_rate()
        elapsed = time.perf_counter() - started
        tokens = sum(len(s.tokens) for s in sequences)
        flops = 6.0 * self.num_params * tokens  # forward + backward of a dense equivalent
        metrics = {
            "train/loss": totals["loss"],
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/entropy": totals["entropy"] / loss_tokens,
            "train/mismatch": totals["abs_logratio"] / loss_tokens,
            "train/mismatch_kl": totals["kl"] / loss_tokens,
            "train/mismatch_masked": totals["masked_seqs"],
            "train/clip_frac": totals["clipped_tokens"] / loss_tokens,
            "train/lr": lr,
            "train/skipped_steps": float(self.skipped_steps),
            "train/tokens": float(tokens),
            "train/loss_tokens": totals["loss_tokens"],
            "train/micro_batches": float(len(micro_batches)),
            "train/step_time_s": elapsed,
            "train/tokens_per_s": tokens / elapsed,
            "train/tflops_per_device": flops / elapsed / self.info.world_size / 1e12,
        }
        metrics.update(agreement)
        peak = _peak_flops()
        if peak:
            metrics["train/mfu"] = flops / elapsed / self.info.world_size / peak
        return metrics

    def _reset_routing(self) -> None:
        if self.replays:
            from megatron_rl.trainer import routing

            routing.reset(self.replays)

    def _routing_agreement(self) -> dict[str, float]:
        """train/routing_agreement (all routed tokens of all MoE layers) and per layer, and train/routing_replayed
        (the share of them routed by the generator's records: 1.0 under rollout replay, 0.0 under measure), from
        the forwards since the last reset: each token counted once (on every sequence-parallel shard, on TP rank 0
        without SP)."""
        if self.routing_shape is None:
            return {}
        from megatron.core import parallel_state

        from megatron_rl.trainer import routing

        distinct = self.model.config.sequence_parallel or parallel_state.get_tensor_model_parallel_rank() == 0
        sums = routing.agreement_sums(self.replays, self.routing_shape.layers, self.info.device)
        if not distinct:
            sums.zero_()
        if dist.get_world_size() > 1:
            dist.all_reduce(sums)
        matched, counted, replayed, offered = sums.cpu().tolist()
        routing.reset(self.replays)
        # over the tokens given targets, not those the router asked about: a router that never asked is 0.0 here
        out = {"train/routing_replayed": sum(replayed) / sum(offered)} if sum(offered) > 0 else {}
        layers = [i for i, n in enumerate(counted) if n > 0]
        if not layers:
            return out
        per_layer = {f"train/routing_agreement/layer{i:02d}": matched[i] / counted[i] for i in layers}
        return {
            "train/routing_agreement": sum(matched[i] for i in layers) / sum(counted[i] for i in layers),
            "train/routing_agreement_min": min(per_layer.values()),
            **per_layer,
            **out,
        }

    def _last_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _nonfinite_grads(self) -> Tensor:
        """How many of this rank's gradient tensors hold a NaN or Inf, as a device scalar: no host sync per
        parameter (megatron's DDP keeps gradients in `main_grad`)."""
        flags = []
        for param in self.model.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                flags.append(torch.isfinite(grad).all().logical_not())
        return torch.stack(flags).sum() if flags else torch.zeros((), device=self.info.device)

    @torch.no_grad()
    def compute_logprobs(self, groups: list[Group]) -> list[list[float]]:
        """Trainer log-probs of every completion token (forward only), per completion in batch order.

        The returned lists are complete on every rank of the last pipeline stage; other ranks get them
        by all-gather (all ranks call this together).
        """
        sequences = sequences_from_groups(groups, self.run)
        micro_batches = self._micro_batches(sequences)
        results: dict[int, list[float]] = {}

        def collect(logprobs_T: Tensor, micro_batch: MicroBatch, record: dict[str, Any]) -> tuple[Any, ...]:
            for s, seq in enumerate(micro_batch.sequences):
                if seq.index >= 0:  # not a filler
                    results[seq.index] = logprobs_T[micro_batch.seq_index_T == s].float().cpu().tolist()
            return logprobs_T.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        self.ddp.eval()
        self._reset_routing()
        try:
            self._run_schedule(micro_batches, forward_only=True, loss_fn=collect)
        finally:
            self.ddp.train()
        self.last_routing_agreement = self._routing_agreement()
        if dist.get_world_size() > 1:
            gathered: list[dict[int, list[float]]] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, results)
            for part in gathered:
                results.update(part)
        return [results[i] for i in range(len(sequences))]


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
