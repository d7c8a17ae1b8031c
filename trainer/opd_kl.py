"""The maths of on-policy distillation beyond the sampled token: top-k and full-vocabulary reverse KL.

On-policy distillation (https://thinkingmachines.ai/blog/on-policy-distillation/) minimises the
reverse KL(πθ ‖ π_T) on the student's own samples. Per response position t, with student logits
z (at the rollout temperature T: z = logits / T) and teacher logprobs log q (temperature 1):

* `sampled` — the one-sample estimate log πθ(x_t) − log q(x_t) enters the *advantage*
  (`advantages.opd_adjust`); nothing here.
* `topk` — K_t = the student's k most likely tokens at t (chosen before the update, by the
  pre-update policy; `topk_ids`). Both distributions are renormalised over K_t:
      p̃_v = exp(z_v) / Σ_{u∈K_t} exp(z_u),   log q̃_v = log q_v − log Σ_{u∈K_t} q_u
      D_t = Σ_{v∈K_t} p̃_v (log p̃_v − log q̃_v)                                 (`topk_reverse_kl`)
  It is the exact reverse KL between the two distributions conditioned on K_t, ≥ 0, and 0 iff
  they agree on K_t; it needs only k teacher logprobs per position (an engine teacher returns
  them through ``token_ids_logprob``). ∂D_t/∂z_v = p̃_v (log p̃_v − log q̃_v − D_t) for v ∈ K_t,
  0 elsewhere.
* `full` — the exact reverse KL over the vocabulary V:
      D_t = Σ_{v∈V} p_v (log p_v − log q_v),   ∂D_t/∂z_v = p_v (log p_v − log q_v − D_t)
  (`full_reverse_kl`). Rows are processed `chunk_rows` at a time and the backward recomputes
  p from the logits, so the extra memory is O(chunk_rows · V) whatever the sequence length.

Both are added to the loss as β·D_t per loss token (objective.py), differentiable through z. Pure
functions over tensors: which rows get which teacher is `opd_step.py`'s business.

Tensor parallelism: Megatron shards logits by vocabulary ([R, V/tp] per rank). Every function
takes the TP process group (None = no TP) and all-reduces what crosses shards: row maxima and
sums of exponentials for normalisers, the gathered logits of the chosen ids, the KL's partial sums.
Global vocabulary ids are used everywhere; rank r holds ids [r·V/tp, (r+1)·V/tp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "full_logprobs",
    "full_reverse_kl",
    "gather_logprobs",
    "select_topk",
    "topk_reverse_kl",
]


def _tp(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or dist.get_world_size(group) == 1:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _tp(group)[1] > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


@torch.no_grad()
def _log_normalizer(z: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """log Σ_v exp(z_v) over the whole (sharded) vocabulary, per row -> [R]."""
    m = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
    s = _all_reduce((z - m.unsqueeze(-1)).exp().sum(-1), group)
    return s.log() + m


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits.float() / (temperature if temperature > 0 else 1.0)


@torch.no_grad()
def full_logprobs(logits: torch.Tensor, temperature: float = 1.0, group=None) -> torch.Tensor:
    """log_softmax over the whole vocabulary of this rank's shard of logits: [R, V/tp] (no grad)."""
    z = _scaled(logits, temperature)
    return z - _log_normalizer(z, group).unsqueeze(-1)


@torch.no_grad()
def select_topk(logits: torch.Tensor, k: int, group=None) -> torch.Tensor:
    """The k largest logits' global vocabulary ids per row: [R, k] (int64, descending)."""
    rank, size = _tp(group)
    local = logits.shape[-1]
    if k > local * size:
        raise ValueError(f"topk k={k} exceeds the vocabulary ({local * size})")
    vals, ids = logits.float().topk(min(k, local), dim=-1)
    ids = ids + rank * local
    if size > 1:  # every rank's candidates, then the global top-k among them
        all_vals, all_ids = (
            [torch.empty_like(vals) for _ in range(size)],
            [torch.empty_like(ids) for _ in range(size)],
        )
        dist.all_gather(all_vals, vals.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
        best = vals.topk(k, dim=-1).indices
        ids = ids.gather(-1, best)
    return ids


class _GatherIds(torch.autograd.Function):
    """z[r, ids[r, j]] for global ids over vocab shards; the backward scatters to the owning shard."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
        rank, size = _tp(group)
        local = z.shape[-1]
        lo = rank * local
        mine = (ids >= lo) & (ids < lo + local)
        idx = (ids - lo).clamp(0, local - 1)
        out = torch.where(mine, z.gather(-1, idx), torch.zeros((), dtype=z.dtype, device=z.device))
        ctx.save_for_backward(mine, idx)
        ctx.local = local
        return _all_reduce(out, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine, idx = ctx.saved_tensors
        g = torch.zeros(*grad.shape[:-1], ctx.local, dtype=grad.dtype, device=grad.device)
        g.scatter_add_(-1, idx, torch.where(mine, grad, torch.zeros_like(grad)))
        return g, None, None


@torch.no_grad()
def gather_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, group=None
) -> torch.Tensor:
    """log_softmax(logits / T) at global ids [R, k] (a teacher's logprobs for the student's top-k)."""
    z = _scaled(logits, temperature)
    return _GatherIds.apply(z, ids, group) - _log_normalizer(z, group).unsqueeze(-1)


def topk_reverse_kl(
    logits: torch.Tensor,
    ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    temperature: float,
    group=None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """D_t over the student's top-k ids, both sides renormalised over them (module docstring) -> [R].

    `valid` [R, k] (bool) marks the ids that count, for rows with fewer than k (a step mixing
    teachers of different k pads the rest); None = all.
    """
    if ids.shape != teacher_logprobs.shape or ids.shape[0] != logits.shape[0]:
        raise ValueError(
            f"topk: logits {tuple(logits.shape)}, ids {tuple(ids.shape)}, teacher {tuple(teacher_logprobs.shape)}"
        )
    z = _GatherIds.apply(_scaled(logits, temperature), ids, group)  # [R, k], differentiable
    t = teacher_logprobs.float().to(z.device)
    if valid is not None:  # a large finite negative, not -inf: 0 · (−inf) would make NaN gradients
        off = ~valid.to(z.device)
        z = z.masked_fill(off, -1e9)
        t = t.masked_fill(off, -1e9)
    log_p = torch.log_softmax(z, dim=-1)
    log_q = torch.log_softmax(t, dim=-1)  # renormalise over K_t
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class _FullReverseKL(torch.autograd.Function):
    """Σ_v p_v (log p_v − log q_v) per row, in row chunks, recomputing p in the backward."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, log_q: torch.Tensor, chunk: int, group) -> torch.Tensor:
        out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
        lse = torch.empty_like(out)
        for a in range(0, z.shape[0], chunk):
            zc = z[a : a + chunk].float()
            lse[a : a + chunk] = _log_normalizer(zc, group)
            log_p = zc - lse[a : a + chunk].unsqueeze(-1)
            qc = log_q[a : a + chunk].to(z.device, torch.float32)
            out[a : a + chunk] = _all_reduce((log_p.exp() * (log_p - qc)).sum(-1), group)
        ctx.save_for_backward(z, log_q, lse, out)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, log_q, lse, kl = ctx.saved_tensors
        g = torch.empty_like(z)
        for a in range(0, z.shape[0], ctx.chunk):
            log_p = z[a : a + ctx.chunk].float() - lse[a : a + ctx.chunk].unsqueeze(-1)
            qc = log_q[a : a + ctx.chunk].to(z.device, torch.float32)
            d = log_p - qc - kl[a : a + ctx.chunk].unsqueeze(-1)
            g[a : a + ctx.chunk] = (grad[a : a + ctx.chunk].unsqueeze(-1) * log_p.exp() * d).to(g.dtype)
        return g, None, None, None


def full_reverse_kl(
    logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    temperature: float,
    chunk_rows: int = 256,
    group=None,
) -> torch.Tensor:
    """Exact KL(πθ ‖ π_T) over the vocabulary per row -> [R]; memory O(chunk_rows · V/tp).

    `teacher_logprobs` is this rank's shard [R, V/tp] of the teacher's log_softmax (temperature 1),
    e.g. from `full_logprobs`; it may stay on the CPU (each chunk is moved to the device in turn).
    """
    if teacher_logprobs.shape != logits.shape:
        raise ValueError(f"full: logits {tuple(logits.shape)}, teacher {tuple(teacher_logprobs.shape)}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive; got {chunk_rows}")
    return _FullReverseKL.apply(_scaled(logits, temperature), teacher_logprobs, chunk_rows, group)
