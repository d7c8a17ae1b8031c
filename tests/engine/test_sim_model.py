"""The simulated engine's scheduler and prefix cache, stepped on a virtual clock (no sleeping, no HTTP).

Every expected time is computed from the parameter table, so these tests check the model's
arithmetic (prefill of uncached tokens, decode cost, queueing, eviction) and not the machine's speed.
"""

from __future__ import annotations

import pytest

from palaestra.testing.sim_model import (
    PARAM_SOURCES,
    BlockCache,
    SimParams,
    SimRequest,
    SimScheduler,
    block_hashes,
    reply_ids,
)

P = SimParams(
    decode_step_s=0.01,
    decode_s_per_context_token=1e-6,
    prefill_tokens_per_s=1000.0,
    kv_capacity_tokens=10_000,
    chunked_prefill_tokens=1000,
    max_running_requests=8,
    output_reserve_ratio=0.0,
    block_tokens=10,
)


def run(sched: SimScheduler, arrivals: list[tuple[float, SimRequest]]) -> list[SimRequest]:
    """Steps the scheduler through its own events and the given arrivals; returns finish order."""
    done: list[SimRequest] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or sched.next_event() is not None:
        nxt = sched.next_event()
        if pending and (nxt is None or pending[0][0] <= nxt):
            t, req = pending.pop(0)
            done += sched.advance(t)
            sched.submit(req, t)
        else:
            assert nxt is not None
            done += sched.advance(nxt)
    return done


def req(prompt: list[int], n: int, t: float = 0.0, seed: int = 0) -> SimRequest:
    return SimRequest(prompt, n, t, seed=seed)


def decode_time(steps: int, context_start: int, batch: int = 1) -> float:
    """Decode time of `steps` steps of one segment, as the model computes it (mean context)."""
    mean_context = context_start + batch * (steps - 1) / 2
    return steps * (P.decode_step_s + P.decode_s_per_context_token * mean_context)


def test_one_request_prefill_then_decode():
    sched = SimScheduler(P)
    r = req(list(range(500)), 5)
    run(sched, [(0.0, r)])
    assert r.cached_tokens == 0
    assert r.first_token == pytest.approx(500 / 1000)  # the prefill samples the first token
    # four more tokens, context 501..504
    assert r.finished == pytest.approx(0.5 + decode_time(4, 501))
    assert len(r.output) == 5 and sched.stats.generated_tokens == 5


def test_second_turn_prefills_only_what_is_new():
    sched = SimScheduler(P)
    first = req(list(range(500)), 20)
    run(sched, [(0.0, first)])
    turn2 = first.prompt + first.output + list(range(9000, 9100))
    second = req(turn2, 5, t=10.0)
    run(sched, [(10.0, second)])
    # 500 prompt + 20 output = 52 whole blocks of 10 cached; the rest (620 - 520 = 100) is prefilled
    assert second.cached_tokens == 520
    assert second.first_token - 10.0 == pytest.approx(100 / 1000)


def test_chunked_prefill_stalls_decoding_of_others():
    """A 3,000-token fresh prompt is three 1,000-token chunks, each run before the next decode step."""
    sched = SimScheduler(P)
    short = req(list(range(100)), 50)
    long = req(list(range(20_000, 23_000)), 2)
    run(sched, [(0.0, short), (0.2, long)])
    # the short request decoded alone for a while, then waited 3 s of prefill, then continued
    assert short.finished > 3.0 + decode_time(49, 101) * 0.9
    assert long.first_token == pytest.approx(0.2 + 3.0, abs=0.02)  # joins at the next step boundary


def test_identical_prompts_are_prefilled_once():
    """A GRPO group: the same prompt at once; one prefill, the others wait and then hit the cache."""
    sched = SimScheduler(P)
    group = [req(list(range(1000)), 3, seed=i) for i in range(4)]
    run(sched, [(0.0, r) for r in group])
    assert sorted(r.cached_tokens for r in group) == [0, 1000, 1000, 1000]
    assert sched.stats.prefilled_tokens == 1000 + 3  # the three hits each compute their last token
    assert len({tuple(r.output) for r in group}) == 4  # sampling seeds give each its own answer


def test_answers_depend_only_on_prompt_and_seed():
    a = reply_ids(list(range(300)), 16, seed=5)
    assert a == reply_ids(list(range(300)), 16, seed=5)
    assert a != reply_ids(list(range(300)), 16, seed=6)
    assert a != reply_ids(list(range(1, 301)), 16, seed=5)


def test_full_engine_queues_then_serves_fcfs():
    p = P.with_overrides(kv_capacity_tokens=2000)
    sched = SimScheduler(p)
    a = req(list(range(1500)), 10)
    b = req(list(range(5000, 6500)), 10)
    run(sched, [(0.0, a), (0.0, b)])
    # b does not fit beside a: it is admitted when a finishes (evicting a's cached blocks)
    assert b.admitted == pytest.approx(a.finished)
    assert sched.stats.evicted_tokens > 0


def test_lru_evicts_least_recently_used_leaves_first():
    cache = BlockCache(block=10)
    old = block_hashes(list(range(40)), 10)
    new = block_hashes(list(range(100, 140)), 10)
    cache.insert(old, now=1.0, locked=False)
    cache.insert(new, now=2.0, locked=False)
    assert cache.evict(20) == 20
    assert cache.match(new) == 4 and cache.match(old) == 2  # old lost its last two blocks
    cache.lock(old[:2], now=3.0)
    assert cache.evict(1000) == 40  # everything but the two locked blocks
    assert cache.match(old) == 2 and cache.match(new) == 0


def test_shared_prefix_blocks_are_not_evicted_while_a_continuation_is_cached():
    cache = BlockCache(block=10)
    base = list(range(30))
    cache.insert(block_hashes(base + list(range(500, 520)), 10), now=1.0, locked=False)
    cache.insert(block_hashes(base + list(range(600, 620)), 10), now=2.0, locked=False)
    cache.evict(20)  # the older branch goes, the shared three blocks stay
    assert cache.match(block_hashes(base, 10)) == 3


def test_decode_grows_with_the_batch_context():
    p = P
    one = SimScheduler(p)
    r1 = req(list(range(4000)), 11)
    run(one, [(0.0, r1)])
    many = SimScheduler(p)
    rs = [req(list(range(i * 10_000, i * 10_000 + 1000)), 11) for i in range(4)]
    run(many, [(0.0, r) for r in rs])
    # 4 x 1000-token contexts cost the same per step as 1 x 4000 (+ per-step base): same decode time
    decode_one = r1.finished - r1.first_token
    decode_many = max(r.finished for r in rs) - max(r.first_token for r in rs)
    assert decode_many == pytest.approx(decode_one, rel=0.01)


def test_retraction_when_outputs_outgrow_memory():
    p = P.with_overrides(kv_capacity_tokens=1000, output_reserve_ratio=0.0, chunked_prefill_tokens=1000)
    sched = SimScheduler(p)
    a = req(list(range(400)), 250)
    b = req(list(range(5000, 5400)), 250)
    run(sched, [(0.0, a), (0.0, b)])
    assert sched.stats.retractions >= 1
    assert a.finished is not None and b.finished is not None
    assert len(a.output) == len(b.output) == 250


def test_arrival_joins_at_the_next_decode_step():
    sched = SimScheduler(P)
    long = req(list(range(100)), 1000)
    late = req(list(range(7000, 7010)), 1)
    run(sched, [(0.0, long), (1.0, late)])
    step = P.decode_step_s + P.decode_s_per_context_token * 200
    assert late.admitted - 1.0 < step * 1.5


def test_bad_requests_are_refused_with_the_parameter_named():
    sched = SimScheduler(P)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        sched.submit(req(list(range(9990)), 20), 0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.submit(req([1, 2, 3], 0), 0.0)
    with pytest.raises(ValueError, match="known"):
        P.with_overrides(kv_capacity=1)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        SimParams(prefill_tokens_per_s=0)


def test_every_parameter_has_a_source():
    import dataclasses

    assert set(PARAM_SOURCES) == {f.name for f in dataclasses.fields(SimParams)}
