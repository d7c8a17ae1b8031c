"""The three-tier snapshot store: exact round trips, eviction order, spill files, prefetch.

The store only needs `named_parameters()`, so these tests use a small real torch module with two
dtypes (float32 and bfloat16, like a mixed-precision model) instead of a Megatron model; the
Megatron-backed store is exercised in tests/trainer/test_model.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from palaestra.trainer.snapshots import SnapshotStore


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Linear(64, 32))
    m[1].to(torch.bfloat16)
    return m


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def _weights(m: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in m.named_parameters()}


def _same(m: torch.nn.Module, want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, want[k]) for k, v in m.named_parameters())


def _store(m: torch.nn.Module, tmp_path, copies: int | None, **kw) -> SnapshotStore:
    probe = SnapshotStore(m)
    budget = None if copies is None else copies * probe.nbytes
    return SnapshotStore(m, host_budget_bytes=budget, spill_dir=tmp_path / "spill", **kw)


def test_budget_must_hold_two_copies(tmp_path):
    m = _model()
    with pytest.raises(ValueError, match="needs at least 2"):
        _store(m, tmp_path, copies=1)


def test_spill_and_reload_are_exact(tmp_path):
    m = _model()
    actor = _state(m)
    store = _store(m, tmp_path, copies=2, prefetch=False)
    teachers = {f"teacher/{i}": _weights(m, i) for i in range(3)}
    for tag, w in teachers.items():
        store.load(tag, w)
    assert store.host_bytes == 2 * store.nbytes  # never more than the budget
    # three teachers, two slots: the least recently used one went to disk
    assert [t for t in teachers if store.tiers(t) == {"disk"}] == ["teacher/0"]
    for tag, w in [*teachers.items(), *reversed(teachers.items())]:
        store.switch(tag)
        assert _same(m, w), tag
    store.switch("actor")
    assert _same(m, actor)
    stats = store.stats()
    assert stats["perf/snap_disk_to_host_mb"] > 0 and stats["perf/snap_host_to_disk_mb"] > 0


def test_a_changed_actor_survives_a_spill(tmp_path):
    m = _model()
    store = _store(m, tmp_path, copies=2, prefetch=False)
    store.load("teacher/a", _weights(m, 1))
    store.load("teacher/b", _weights(m, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5)
    store.mark_live_changed()  # as after an optimizer step: no stored copy is valid
    changed = _state(m)
    store.switch("teacher/a")  # stores the actor (evicting a teacher to disk)
    store.switch("teacher/b")  # must evict the actor or teacher/a: the actor is written out first
    store.switch("actor")
    assert _same(m, changed)


def test_the_spill_file_is_plain_safetensors(tmp_path):
    from safetensors import safe_open

    from palaestra.trainer.snapshot_tiers import spill_path

    m = _model()
    store = _store(m, tmp_path, copies=2, prefetch=False)
    w = _weights(m, 7)
    store.load("teacher/x", w)
    store.load("teacher/y", _weights(m, 8))
    store.load("teacher/z", _weights(m, 9))  # evicts teacher/x, the least recently used
    assert store.tiers("teacher/x") == {"disk"}
    with safe_open(str(spill_path(store.spill_dir, "teacher/x")), framework="pt") as f:
        assert sorted(f.keys()) == ["bfloat16", "float32"]
        f32 = torch.cat([w[k].reshape(-1) for k in ("0.weight", "0.bias")])
        bf16 = torch.cat([w[k].reshape(-1) for k in ("1.weight", "1.bias")])
        assert torch.equal(f.get_tensor("float32"), f32) and torch.equal(f.get_tensor("bfloat16"), bf16)


def test_eviction_follows_the_plan_then_lru(tmp_path):
    m = _model()
    store = _store(m, tmp_path, copies=3, prefetch=False)
    store.load("teacher/a", _weights(m, 1))
    store.load("teacher/b", _weights(m, 2))
    store.save("ref")  # three slots, none of them on disk yet
    # no plan: storing the actor on the way to teacher/b evicts the least recently used
    store.switch("teacher/b")
    assert store.tiers("teacher/a") == {"disk"} and "host" in store.tiers("ref")
    store.switch("actor")
    store.mark_live_changed()  # the actor's copy is stale: its slot is free again
    # with a plan, the farthest next use goes: teacher/b (last in the plan), not ref (the LRU)
    store.plan(["teacher/a", "ref", "actor", "teacher/b"])
    store.switch("teacher/a")
    assert store.tiers("teacher/b") == {"disk"}
    assert "host" in store.tiers("ref") and "host" in store.tiers("actor")
    # a tag whose spill file is current is dropped before one that would have to be written
    store.switch("teacher/b")  # needs a slot: teacher/a (live, but on disk) goes, not ref
    assert store.tiers("teacher/a") == {"disk"} and "host" in store.tiers("ref")


def test_prefetch_brings_the_next_planned_teacher_in_the_background(tmp_path):
    m = _model()
    store = _store(m, tmp_path, copies=2, prefetch=True)
    teachers = {f"teacher/{i}": _weights(m, i) for i in range(3)}
    for tag, w in teachers.items():
        store.load(tag, w)
    actor = _state(m)
    store.stats()
    for step in range(3):
        order = [*teachers, "actor"] if step % 2 == 0 else [*reversed(teachers), "actor"]
        store.plan(order)
        for tag in order:
            store.wait_prefetch()  # stands in for the forward pass the prefetch overlaps with
            if tag != "actor":
                assert store.tiers(tag) & {"host", "live"}, f"step {step}: {tag} was not prefetched"
            store.switch(tag)
            assert _same(m, teachers.get(tag, actor)), tag
        stats = store.stats()
        assert stats["perf/snap_prefetched_loads"] >= 1, stats  # two slots, three teachers: loads happen
        if step > 0:  # after the first step (which spills the freshly loaded teachers)
            assert stats["perf/snap_demand_loads"] == 0, stats  # every load was a prefetch
    store.close()


def test_prefetch_never_evicts_what_is_needed_sooner(tmp_path):
    m = _model()
    store = _store(m, tmp_path, copies=2, prefetch=True)
    store.load("teacher/a", _weights(m, 1))
    store.load("teacher/b", _weights(m, 2))
    store.load("teacher/c", _weights(m, 3))  # teacher/a goes to disk
    assert store.tiers("teacher/a") == {"disk"}
    # b and c are needed before a: the prefetch of a may not take their slots
    store.plan(["teacher/b", "teacher/c", "teacher/a"])
    store.wait_prefetch()
    assert store.tiers("teacher/a") == {"disk"}
    assert "host" in store.tiers("teacher/b") and "host" in store.tiers("teacher/c")
    store.close()


def test_random_switching_with_prefetch_stays_exact(tmp_path):
    """A soak over random plans, skipped plan entries and optimizer-like changes of the actor."""
    m = _model()
    store = _store(m, tmp_path, copies=3, prefetch=True)
    want = {f"teacher/{i}": _weights(m, 10 + i) for i in range(4)}
    for tag, w in want.items():
        store.load(tag, w)
    store.save("ref")
    want["ref"] = _state(m)
    rng = random.Random(0)
    for _ in range(25):
        store.switch("actor")
        with torch.no_grad():
            for p in m.parameters():
                p.add_(rng.random())
        store.mark_live_changed()
        want["actor"] = _state(m)
        order = rng.sample(sorted(want), k=rng.randint(2, 5))
        store.plan(order)
        for tag in order:
            if rng.random() < 0.2:
                continue  # the plan is advice: a tag may be skipped
            store.switch(tag)
            assert _same(m, want[tag]), tag
    store.switch("actor")
    assert _same(m, want["actor"])
    assert store.host_bytes <= 3 * store.nbytes
    store.close()


def test_tensors_and_copy_read_through_the_disk_tier(tmp_path):
    m = _model()
    store = _store(m, tmp_path, copies=2, prefetch=False)
    w = _weights(m, 4)
    store.load("teacher/a", w)
    store.load("teacher/b", _weights(m, 5))
    store.load("teacher/c", _weights(m, 6))
    assert store.tiers("teacher/a") == {"disk"}
    assert all(torch.equal(v, w[k]) for k, v in store.tensors("teacher/a").items())
    store.copy("teacher/a", "old_actor")
    store.switch("old_actor")
    assert _same(m, w)
    store.drop(["teacher/b"])
    assert "teacher/b" not in store.tags


def test_a_switch_waits_for_a_prefetch_holding_the_last_free_slot(tmp_path, monkeypatch):
    """With every slot taken, a prefetch filling one of them must finish before a switch that has
    no other slot to use (a read made slow on purpose — a test double for a slow disk — so the
    switch arrives while the prefetch still holds its slot)."""
    import time

    from palaestra.trainer import snapshots

    real = snapshots.read_spill
    monkeypatch.setattr(snapshots, "read_spill", lambda path, flat: (time.sleep(0.3), real(path, flat))[1])
    m = _model()
    store = _store(m, tmp_path, copies=2, prefetch=True)
    w = {t: _weights(m, i) for i, t in enumerate(["teacher/a", "teacher/b", "teacher/c"])}
    for tag, weights in w.items():
        store.load(tag, weights)  # teacher/a goes to disk
    store.mark_live_changed()  # the actor has no stored copy: leaving it needs a slot
    store.plan(["teacher/a"])  # prefetch: evicts teacher/b, then reads teacher/a slowly
    time.sleep(0.1)
    store.switch("teacher/c")  # needs a slot for the actor: only teacher/a's, once it is loaded
    assert _same(m, w["teacher/c"])
    store.switch("teacher/a")
    assert _same(m, w["teacher/a"])
    store.close()


def test_without_a_spill_dir_a_temporary_one_is_made_at_the_first_spill(tmp_path, monkeypatch):
    # a trainer killed before close() leaves its spill directory behind: one it never needed is
    # never made (every store without a budget, or whose budget holds every tag)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    m = _model()
    probe = SnapshotStore(m)
    probe.load("teacher/0", _weights(m, 0))
    store = SnapshotStore(m, host_budget_bytes=2 * probe.nbytes, prefetch=False)
    store.load("teacher/0", _weights(m, 0))
    store.load("teacher/1", _weights(m, 1))
    assert list(tmp_path.iterdir()) == []
    store.load("teacher/2", _weights(m, 2))  # two slots, three teachers: one goes to disk
    (made,) = tmp_path.iterdir()
    assert made.name.startswith("snapshots-") and any(made.iterdir())
    store.drop(["teacher/0", "teacher/1", "teacher/2"])
    store.close()
    probe.close()
    assert list(tmp_path.iterdir()) == []
