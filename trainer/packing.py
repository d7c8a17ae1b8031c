"""Samples -> packed micro-batches -> data-parallel ranks ("pack first, distribute second").

1. `first_fit_decreasing` packs whole samples into micro-batches of at most
   ``max_tokens_per_microbatch`` tokens (a sample longer than that gets a micro-batch of its own).
   With several DP ranks the same budget is then spread over a multiple of the rank count
   (`balanced_fill`), so the next step has even pieces to hand out.
   Samples are concatenated without padding; `cu_seqlens` marks where each one starts, and the
   model sees them as THD with Megatron's `PackedSeqParams` (positions restart per sample).
2. `karmarkar_karp` splits the work into one list per DP rank so that the estimated FLOPs per
   rank (`sequence_flops`: linear in length for the matmuls, quadratic for attention) are as even
   as possible (the largest differencing method, k-way).

`schedule` does these two in either order. The default, ``order="distribute_first"``, runs
Karmarkar-Karp over the *samples* and then packs each rank's share with first-fit decreasing:
the pieces being balanced are single samples, so on a long-tailed batch the ranks end within a
fraction of a percent of each other. ``order="pack_first"`` packs first and balances whole
micro-batches, which are near-identical full packs, so the last few cannot be evened out
(bench/trainer.py prints both against round-robin).

The same schedule is used for every forward pass of a step (teacher, reference and old-policy
logprobs, training): the same sample always sits in the same pack at the same offsets, so the
logprobs that feed the importance ratio are computed the same way twice.

`MicroBatch` is the typed batch: packed inputs plus one row per *response* token (where it is
predicted in the pack, its id, its loss mask and rollout logprob), and the per-row inputs of the
objective that a step fills in (logprobs, advantages, weights, the OPD teachers' targets), every
one a named field with its shape checked by `MicroBatch.check()`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from palaestra.sample import Sample
from palaestra.trainer.convert import HFArchitecture

__all__ = [
    "MicroBatch",
    "balanced_fill",
    "build_micro_batch",
    "first_fit_decreasing",
    "karmarkar_karp",
    "round_robin",
    "schedule",
    "sequence_flops",
    "dummy_micro_batch",
    "Schedule",
]


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bins of indices into `lengths`, each summing to at most `max_tokens` (oversized items alone).

    Longest first, each into the first bin with room. Deterministic: ties keep input order, and
    the items inside a bin are listed in input order.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)  # negative for an oversized item: nothing else fits
    return [sorted(b) for b in bins]


def balanced_fill(
    lengths: Sequence[int], costs: Sequence[float], num_bins: int, max_tokens: int
) -> list[list[int]]:
    """Packs items into (at least) `num_bins` bins of at most `max_tokens`, evening out their costs.

    Most expensive first, each into the cheapest bin that still has room (worst-fit decreasing);
    an item that fits nowhere opens a new bin (an oversized item gets one of its own). Used when
    there are several DP ranks: first-fit decreasing minimises the number of micro-batches but
    leaves its last ones nearly empty, so with few micro-batches per rank no assignment can be
    even; the same token budget spread over a multiple of the rank count can.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-costs[i], i))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    load = [0.0] * num_bins
    room = [max_tokens] * num_bins
    for i in order:
        n = lengths[i]
        fits = [b for b in range(len(bins)) if n <= room[b] or (not bins[b] and n > max_tokens)]
        if fits:
            b = min(fits, key=lambda j: (load[j], j))
        else:
            bins.append([])
            load.append(0.0)
            room.append(max_tokens)
            b = len(bins) - 1
        bins[b].append(i)
        load[b] += costs[i]
        room[b] -= n
    return [sorted(b) for b in bins if b]


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """k-way partition of item indices with near-equal weight sums (largest differencing method).

    Every item starts as a k-tuple of subsets (itself, then k-1 empty ones). The two tuples with the
    largest spread (max - min sum) are merged by pairing the heaviest subset of one with the
    lightest of the other, which cancels their differences; repeat until one tuple is left.
    Returns k lists (some may be empty when there are fewer items than k), heaviest first.
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    counter = itertools.count()  # tie-breaker so heapq never compares the payloads
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(weights):
        parts = [(float(w), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(w), next(counter), parts))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])
        b = sorted(b, key=lambda p: p[0])
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, b, strict=True)]
        sums = [w for w, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), next(counter), merged))
    parts = sorted(heap[0][2], key=lambda p: -p[0])
    return [sorted(ids) for _, ids in parts]


def round_robin(n: int, k: int) -> list[list[int]]:
    """Item i to rank i mod k: the baseline the benchmark compares Karmarkar-Karp with."""
    return [list(range(r, n, k)) for r in range(k)]


def sequence_flops(length: int, arch: HFArchitecture) -> float:
    """Forward FLOPs of one sequence: 2 x active parameters x tokens, plus causal attention scores.

    The attention term (QK^T and PV over the causal half) is what makes long sequences cost more
    than their token count; the constant factor of the backward pass does not change the balance.
    """
    h, layers = arch.hidden_size, arch.num_layers
    q_dim = arch.num_heads * arch.head_dim
    kv_dim = 2 * arch.num_kv_heads * arch.head_dim
    # An MoE layer computes its top-k experts and shared expert per token, not all its experts.
    moe_mlp = arch.moe_topk * arch.moe_intermediate_size + arch.shared_expert_intermediate_size
    mlp = sum(moe_mlp if i in arch.moe_layers else arch.intermediate_size for i in range(layers))
    per_layer = h * (q_dim + kv_dim) + q_dim * h
    linear = 2.0 * length * (layers * per_layer + 3 * h * mlp + h * arch.vocab_size)
    attention = 2.0 * layers * q_dim * length * (length + 1)  # 2 matmuls x causal half x 2 FLOPs
    return linear + attention


@dataclass
class MicroBatch:
    """One packed micro-batch: inputs for the model and one row per response token.

    Packed inputs (length T = total tokens): `tokens`, `position_ids` (restart at 0 per sample),
    `cu_seqlens` (int32, n+1 boundaries). Response rows (length R = total response tokens, in pack
    order): `label_positions` (position in the pack whose logits predict the token), `targets`,
    `loss_mask` (1.0 = sampled by the policy), `rollout_logprobs`, `seq_index` (0..n-1, which
    packed sample), and `response_offsets` (n+1 boundaries of each sample's rows).
    `sample_indices` are the samples' positions in the step's list.

    The fields after `dummy` are filled during a step, each by one phase (None until then or
    when the config does not use it); all have R rows.
    """

    sample_indices: list[int]
    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    label_positions: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    seq_index: torch.Tensor
    response_offsets: list[int]
    dummy: bool = False
    """A rank with no real work runs one of these (one row, loss mask 0) so collectives still match."""

    constrained: torch.Tensor | None = None
    """1.0 on rows the policy sampled under a decoding constraint (`Sample.constrained`): their
    rollout logprob is the constrained distribution's, which the trainer does not compute, so they
    stay out of TIS, RS and the mismatch metrics (objective.py), [R]. None: no row was."""

    routing: list[torch.Tensor] | None = None
    """Routing replay (trainer/moe.py): per MoE layer, the experts of every packed token, [T, top_k]
    (r3: the rollout's; r2: recorded in the old-policy pass). None: the routers choose."""

    # -- logprobs of the sampled tokens: Trainer.step --------------------------------------------
    old_logprobs: torch.Tensor | None = None
    """log π_old(x_t), the PPO ratio's denominator (the pre-update or `old_actor` weights), [R]."""

    ref_logprobs: torch.Tensor | None = None
    """log π_ref(x_t) of the `ref` snapshot (kl.coef > 0), [R]."""

    teacher_logprobs: torch.Tensor | None = None
    """log π_teacher(x_t) of the row's route, temperature 1 (OPD: opd_step.py), [R]."""

    # -- the objective's per-token inputs: objective.token_inputs -------------------------------
    advantages: torch.Tensor | None = None
    """Â_t: the estimator's advantage of the row's sample, plus the sampled-granularity OPD and
    the KL-reward terms, [R] float32."""

    loss_weight: torch.Tensor | None = None
    """w_t = loss_mask · rs_keep: what the row's loss counts for (0 = context or RS-masked), [R]."""

    tis_weight: torch.Tensor | None = None
    """clip(exp(old − roll), tis.clip_low, tis.clip_high), the row's TIS factor (tis.enabled), [R]."""

    tis_clipped: torch.Tensor | None = None
    """1.0 where the TIS weight was clipped (strictly outside the bounds), else 0.0 (tis.enabled), [R]."""

    # -- on-policy distillation: opd_step.Distiller.score ---------------------------------------
    opd_coef_sampled: torch.Tensor | None = None
    """β of the row's route where its granularity is `sampled` (enters Â_t), else 0, [R] float32."""

    opd_coef_topk: torch.Tensor | None = None
    """β of the row's route where its granularity is `topk` (a loss term), else 0, [R] float32."""

    opd_coef_full: torch.Tensor | None = None
    """β of the row's route where its granularity is `full` (a loss term), else 0, [R] float32."""

    opd_route: torch.Tensor | None = None
    """Index of the row's route in `Distiller.labels` (per-route metrics), [R] int64."""

    opd_topk_ids: torch.Tensor | None = None
    """The student's k most likely vocabulary ids per row, chosen by the pre-update policy, [R, k]
    int64 (rows that are not `topk` hold zeros)."""

    opd_topk_teacher: torch.Tensor | None = None
    """The teacher's logprobs of `opd_topk_ids`, [R, k] float32."""

    opd_topk_valid: torch.Tensor | None = None
    """Which of the k ids count (a route with a smaller k pads the rest), [R, k] bool."""

    opd_full_teacher: torch.Tensor | None = None
    """The teacher's log_softmax over this rank's vocabulary shard, [R, V/tp] float32 (on the CPU)."""

    opd_rkl: torch.Tensor | None = None
    """Each row's reverse-KL estimate, left by the training pass for per-route metrics: k1
    (old − teacher) on sampled rows, D_t on topk/full rows; detached, [R] float32."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.targets.shape[0])

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def check(self) -> None:
        """Raises with the actual shapes when the fields disagree."""
        t, r = self.num_tokens, self.num_rows
        n = int(self.cu_seqlens.shape[0]) - 1  # packed sequences
        if len(self.sample_indices) != (0 if self.dummy else n):
            raise ValueError(f"{len(self.sample_indices)} sample indices for {n} packed sequences")
        if self.position_ids.shape != (t,):
            raise ValueError(f"position_ids {tuple(self.position_ids.shape)} for {t} tokens")
        if self.cu_seqlens.shape != (n + 1,) or int(self.cu_seqlens[-1]) != t:
            raise ValueError(f"cu_seqlens {self.cu_seqlens.tolist()} for {n} samples / {t} tokens")
        if len(self.response_offsets) != n + 1 or self.response_offsets[-1] != r:
            raise ValueError(f"response_offsets {self.response_offsets} for {n} samples / {r} rows")
        for name in ("label_positions", "loss_mask", "rollout_logprobs", "seq_index"):
            if getattr(self, name).shape != (r,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({r},)")
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            if value is not None and value.shape != (r,):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({r},)")
        if self.opd_route is not None and self.opd_route.dtype != torch.long:
            raise ValueError(f"opd_route has dtype {self.opd_route.dtype}, expected torch.int64")
        ids = self.opd_topk_ids
        if ids is not None and (ids.dim() != 2 or ids.shape[0] != r or ids.dtype != torch.long):
            raise ValueError(
                f"opd_topk_ids has shape {tuple(ids.shape)} {ids.dtype}, expected ({r}, k) int64"
            )
        for name in ("opd_topk_teacher", "opd_topk_valid"):
            value = getattr(self, name)
            if value is not None and (ids is None or value.shape != ids.shape):
                want = "no opd_topk_ids" if ids is None else f"opd_topk_ids {tuple(ids.shape)}"
                raise ValueError(f"{name} has shape {tuple(value.shape)}, with {want}")
        if self.opd_topk_valid is not None and self.opd_topk_valid.dtype != torch.bool:
            raise ValueError(f"opd_topk_valid has dtype {self.opd_topk_valid.dtype}, expected torch.bool")
        full = self.opd_full_teacher
        if full is not None and (full.dim() != 2 or full.shape[0] != r):
            raise ValueError(
                f"opd_full_teacher has shape {tuple(full.shape)}, expected ({r}, vocabulary shard)"
            )

    def packed_seq_params(self, device: torch.device | str | None = None):
        """Megatron's THD description of this pack."""
        from palaestra.trainer.cpu_shim import import_megatron

        import_megatron()
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device) if device is not None else self.cu_seqlens
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def per_sample(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Splits an R-row tensor into one tensor per packed sample (response order)."""
        o = self.response_offsets
        return [rows[o[i] : o[i + 1]] for i in range(len(self.sample_indices))]


# The step's per-row fields of `MicroBatch`: one value per response row, shape (R,).
_ROW_FIELDS = (
    "constrained", "old_logprobs", "ref_logprobs", "teacher_logprobs", "advantages", "loss_weight", "tis_weight",
    "tis_clipped", "opd_coef_sampled", "opd_coef_topk", "opd_coef_full", "opd_route", "opd_rkl",
)  # fmt: skip


def build_micro_batch(samples: Sequence[Sample], indices: Sequence[int]) -> MicroBatch:
    """Packs `samples[i] for i in indices` into one `MicroBatch` (no padding)."""
    tokens, positions, cu = [], [], [0]
    label_pos, targets, mask, rollout, seq_index, offsets = [], [], [], [], [], [0]
    constrained: list[int] = []
    any_constrained = any(samples[i].constrained is not None for i in indices)
    for s_i, idx in enumerate(indices):
        s = samples[idx]
        n, p = len(s.tokens), s.prompt_len
        if p < 1:
            raise ValueError(
                f"sample {s.sample_id}: prompt_len must be >= 1 to score its first response token"
            )
        start = cu[-1]
        tokens.extend(s.tokens)
        positions.extend(range(n))
        cu.append(start + n)
        label_pos.extend(range(start + p - 1, start + n - 1))
        targets.extend(s.tokens[p:])
        mask.extend(s.loss_mask)
        rollout.extend(s.rollout_logprobs)
        if any_constrained:
            constrained.extend(s.constrained if s.constrained is not None else [0] * (n - p))
        seq_index.extend([s_i] * (n - p))
        offsets.append(offsets[-1] + n - p)
    mb = MicroBatch(
        sample_indices=list(indices),
        tokens=torch.tensor(tokens, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        label_positions=torch.tensor(label_pos, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        rollout_logprobs=torch.tensor(rollout, dtype=torch.float32),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        response_offsets=offsets,
        constrained=torch.tensor(constrained, dtype=torch.float32) if any_constrained else None,
    )
    mb.check()
    return mb


def dummy_micro_batch(token_id: int = 0) -> MicroBatch:
    """Two tokens, one response row with loss mask 0: contributes nothing but keeps collectives in step."""
    s = Sample(
        sample_id="dummy",
        session_id="dummy",
        group_id="dummy",
        env="",
        task_id="",
        tokens=[token_id, token_id],
        prompt_len=1,
        loss_mask=[0],
        rollout_logprobs=[0.0],
        weight_versions=[""],
    )
    mb = build_micro_batch([s], [0])
    mb.sample_indices = []  # it stands for no sample of the step
    mb.dummy = True
    mb.check()
    return mb


@dataclass
class Schedule:
    """The step's micro-batches: `per_rank[r]` lists the bins (sample indices) of DP rank r."""

    bins: list[list[int]]
    per_rank: list[list[int]]  # indices into `bins`
    bin_tokens: list[int]
    bin_flops: list[float]

    def rank_flops(self) -> list[float]:
        return [sum(self.bin_flops[b] for b in bins) for bins in self.per_rank]

    def fill_ratio(self, max_tokens: int) -> float:
        """Real tokens / capacity of the micro-batches (how full the packs are; 1.0 = no spare room).

        Packing never processes padding, so processed tokens always equal real tokens; this
        measures how few forward passes the packing needs instead.
        """
        if not self.bins:
            return 1.0
        slots = sum(max(max_tokens, n) for n in self.bin_tokens)
        return sum(self.bin_tokens) / slots


def schedule(
    lengths: Sequence[int],
    max_tokens: int,
    dp_size: int,
    arch: HFArchitecture,
    order: Literal["pack_first", "distribute_first"] = "distribute_first",
) -> Schedule:
    """This step's micro-batches and which DP rank runs each.

    distribute_first (the default): Karmarkar-Karp over the *samples* by estimated FLOPs, then
    first-fit decreasing per rank. With one rank this is plain FFD (fewest micro-batches). On the
    bench's long-tailed batch (1024 samples, 2048-token packs) max/mean rank load is 1.000 over 2-8
    ranks and 1.002 over 16, against 1.011-1.058 for pack_first.
    pack_first: pack, then distribute the micro-batches by FLOPs (Karmarkar-Karp); with several
    ranks, as many micro-batches as FFD needs rounded up to a multiple of `dp_size`, filled evenly
    by cost (`balanced_fill`).
    """
    costs = [sequence_flops(n, arch) for n in lengths]
    if order == "distribute_first":
        bins, per_rank = [], []
        for part in karmarkar_karp(costs, dp_size):
            local = first_fit_decreasing([lengths[i] for i in part], max_tokens)
            per_rank.append(list(range(len(bins), len(bins) + len(local))))
            bins.extend(sorted(part[j] for j in b) for b in local)
    elif order == "pack_first":
        bins = first_fit_decreasing(lengths, max_tokens)
        if dp_size > 1 and bins:
            bins = balanced_fill(lengths, costs, -(-len(bins) // dp_size) * dp_size, max_tokens)
        per_rank = None
    else:
        raise ValueError(f"unknown schedule order {order!r} (pack_first, distribute_first)")
    bin_tokens = [sum(lengths[i] for i in b) for b in bins]
    bin_flops = [sum(costs[i] for i in b) for b in bins]
    if per_rank is None:
        per_rank = karmarkar_karp(bin_flops, dp_size)
    return Schedule(bins=bins, per_rank=per_rank, bin_tokens=bin_tokens, bin_flops=bin_flops)
