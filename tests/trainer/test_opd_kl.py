"""The three distillation granularities against direct computations on small tensors.

Values and gradients of `opd_kl.topk_reverse_kl` and `opd_kl.full_reverse_kl` are compared with
the formulas written out with plain torch ops (autograd through log_softmax); the sampled-token
term with `advantages.opd_adjust`. No tensor parallelism here (group=None).
"""

from __future__ import annotations

import pytest
import torch

from palaestra.trainer import advantages as adv
from palaestra.trainer import opd_kl


def _logits(rows: int = 7, vocab: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, vocab, generator=g) * 2
    teacher = torch.randn(rows, vocab, generator=g) * 2
    return student, teacher


def test_sampled_is_the_advantage_term():
    a = torch.tensor([0.5, -1.0, 0.0])
    old, teacher = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.5, -3.0, -0.5])
    assert torch.allclose(adv.opd_adjust(a, old, teacher, 0.5), a - 0.5 * (old - teacher))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_reverse_kl_matches_the_direct_sum(temperature):
    student, teacher = _logits()
    log_q = torch.log_softmax(teacher, -1)
    x = student.clone().requires_grad_(True)
    want = (torch.softmax(x / temperature, -1) * (torch.log_softmax(x / temperature, -1) - log_q)).sum(-1)
    w = torch.randn(want.shape[0])
    (want * w).sum().backward()
    want_grad = x.grad.clone()

    y = student.clone().requires_grad_(True)
    got = opd_kl.full_reverse_kl(y, opd_kl.full_logprobs(teacher), temperature, chunk_rows=3)
    (got * w).sum().backward()
    assert torch.allclose(got, want.detach(), atol=1e-5)
    assert torch.allclose(y.grad, want_grad, atol=1e-5)
    assert (got >= -1e-6).all()


def test_full_reverse_kl_is_zero_for_the_teacher_itself():
    student, _ = _logits()
    kl = opd_kl.full_reverse_kl(student, opd_kl.full_logprobs(student), 1.0, chunk_rows=2)
    assert torch.allclose(kl, torch.zeros_like(kl), atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_reverse_kl_matches_the_renormalised_direct_sum(temperature):
    student, teacher = _logits()
    k = 5
    ids = opd_kl.select_topk(student, k)
    assert torch.equal(ids, student.topk(k, -1).indices)
    t_lp = opd_kl.gather_logprobs(teacher, ids)  # what a teacher reports for those ids
    assert torch.allclose(t_lp, torch.log_softmax(teacher, -1).gather(-1, ids), atol=1e-6)

    x = student.clone().requires_grad_(True)
    zk = (x / temperature).gather(-1, ids)
    log_p = zk - zk.logsumexp(-1, keepdim=True)
    log_q = t_lp - t_lp.logsumexp(-1, keepdim=True)
    want = (log_p.exp() * (log_p - log_q)).sum(-1)
    w = torch.randn(want.shape[0])
    (want * w).sum().backward()

    y = student.clone().requires_grad_(True)
    got = opd_kl.topk_reverse_kl(y, ids, t_lp, temperature)
    (got * w).sum().backward()
    assert torch.allclose(got, want.detach(), atol=1e-5)
    assert torch.allclose(y.grad, x.grad, atol=1e-5)
    outside = torch.ones_like(student, dtype=torch.bool).scatter_(-1, ids, False)
    assert (y.grad[outside] == 0).all()  # only the top-k logits get a gradient


def test_topk_with_the_whole_vocabulary_is_the_full_kl():
    student, teacher = _logits(vocab=12)
    ids = opd_kl.select_topk(student, 12)
    topk = opd_kl.topk_reverse_kl(student, ids, opd_kl.gather_logprobs(teacher, ids), 1.0)
    full = opd_kl.full_reverse_kl(student, opd_kl.full_logprobs(teacher), 1.0)
    assert torch.allclose(topk, full, atol=1e-5)


def test_topk_valid_mask_drops_the_padded_ids():
    student, teacher = _logits()
    ids = opd_kl.select_topk(student, 6)
    t_lp = opd_kl.gather_logprobs(teacher, ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[::2, 3:] = False  # even rows come from a k=3 teacher, padded to 6
    x = student.clone().requires_grad_(True)
    got = opd_kl.topk_reverse_kl(x, ids, t_lp, 1.0, valid=valid)
    got.sum().backward()
    short = opd_kl.topk_reverse_kl(student[::2], ids[::2, :3], t_lp[::2, :3], 1.0)
    full = opd_kl.topk_reverse_kl(student[1::2], ids[1::2], t_lp[1::2], 1.0)
    assert torch.allclose(got[::2], short, atol=1e-5) and torch.allclose(got[1::2], full, atol=1e-5)
    assert torch.isfinite(x.grad).all()


def test_bad_shapes_name_what_differs():
    student, teacher = _logits()
    with pytest.raises(ValueError, match="topk: logits"):
        opd_kl.topk_reverse_kl(student, student.topk(3, -1).indices, torch.zeros(7, 4), 1.0)
    with pytest.raises(ValueError, match="full: logits"):
        opd_kl.full_reverse_kl(student, teacher[:, :10], 1.0)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        opd_kl.select_topk(student, 51)


TP_WORKER = """
import sys, torch, torch.distributed as dist
from palaestra.trainer import opd_kl
rank, out, rdzv = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=2)
g = torch.Generator().manual_seed(0)
student, teacher = torch.randn(7, 50, generator=g) * 2, torch.randn(7, 50, generator=g) * 2
shard = slice(25 * rank, 25 * (rank + 1))  # vocab-parallel: rank r holds ids [25r, 25r + 25)
group = dist.group.WORLD
ids = opd_kl.select_topk(student[:, shard], 5, group)
t_lp = opd_kl.gather_logprobs(teacher[:, shard], ids, 1.0, group)
x = student[:, shard].clone().requires_grad_(True)
topk = opd_kl.topk_reverse_kl(x, ids, t_lp, 0.7, group)
topk.sum().backward()
y = student[:, shard].clone().requires_grad_(True)
full = opd_kl.full_reverse_kl(y, opd_kl.full_logprobs(teacher[:, shard], 1.0, group), 0.7, 3, group)
full.sum().backward()
torch.save({"ids": ids, "t_lp": t_lp, "topk": topk.detach(), "topk_grad": x.grad, "full": full.detach(),
            "full_grad": y.grad}, out)
dist.barrier()  # both ranks done before either tears down (a peer gone mid-teardown aborts gloo)
dist.destroy_process_group()
"""


def test_vocab_parallel_matches_one_process(tmp_path):
    """Two gloo processes, each with half the vocabulary, give the single-process values and gradients."""
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(TP_WORKER)
    rdzv = f"file://{tmp_path / 'rdzv'}"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / f"r{r}.pt"), rdzv])
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]

    student, teacher = _logits()
    ids = opd_kl.select_topk(student, 5)
    t_lp = opd_kl.gather_logprobs(teacher, ids)
    x = student.clone().requires_grad_(True)
    topk = opd_kl.topk_reverse_kl(x, ids, t_lp, 0.7)
    topk.sum().backward()
    y = student.clone().requires_grad_(True)
    full = opd_kl.full_reverse_kl(y, opd_kl.full_logprobs(teacher), 0.7, chunk_rows=3)
    full.sum().backward()
    for r in ranks:
        assert torch.equal(r["ids"], ids)
        assert torch.allclose(r["t_lp"], t_lp, atol=1e-5)
        assert torch.allclose(r["topk"], topk.detach(), atol=1e-5)
        assert torch.allclose(r["full"], full.detach(), atol=1e-5)
    assert torch.allclose(torch.cat([r["topk_grad"] for r in ranks], -1), x.grad, atol=1e-5)
    assert torch.allclose(torch.cat([r["full_grad"] for r in ranks], -1), y.grad, atol=1e-5)
