"""The placement layer's decisions (gateway/engine_side/placement.py), on a virtual clock: no engines, no timing."""

from __future__ import annotations

import pytest

from palaestra.gateway.engine_side.placement import Call, PlacementConfig, SessionPlacement

URLS = [f"http://w{i}" for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def turn(
    p: SessionPlacement,
    session: str,
    k: int,
    prompt: int,
    out: int = 100,
    *,
    env: str = "e",
    group: str | None = None,
):
    route = p.choose(Call(session, env, group, k, prompt, out))
    route.done(cached_tokens=0, output_tokens=out)
    return route


def test_a_session_stays_on_its_worker_across_turns():
    p = SessionPlacement(PlacementConfig(), URLS, clock=Clock())
    workers = {turn(p, "s", k, 1000 + 200 * k).worker for k in range(10)}
    assert len(workers) == 1
    assert p.moves == 0


def test_new_sessions_go_to_the_least_loaded_worker():
    p = SessionPlacement(PlacementConfig(groups="apart"), URLS, clock=Clock())
    for i in range(8):
        turn(p, f"s{i}", 0, 5000)
    snap = p.snapshot()
    assert [w["sessions"] for w in snap["workers"]] == [2, 2, 2, 2]
    # a worker that holds a long context gets no new session until the others catch up
    p2 = SessionPlacement(PlacementConfig(groups="apart"), URLS, clock=Clock())
    big = turn(p2, "big", 0, 40_000)
    for i in range(3):
        assert turn(p2, f"small{i}", 0, 2000).worker != big.worker


def test_a_group_shares_a_worker_while_that_worker_stays_within_bounds():
    p = SessionPlacement(PlacementConfig(epsilon=0.25), URLS, clock=Clock())
    first = turn(p, "g-0", 0, 1000, group="g")
    # the other workers carry load already, so the group's worker stays within (1 + eps) x mean
    for i in range(3):
        for j in range(4):
            turn(p, f"other-{i}-{j}", 0, 1000, group=f"o{i}{j}")
    placed = [turn(p, f"g-{i}", 0, 1000, group="g").worker for i in range(1, 4)]
    assert placed.count(first.worker) >= 2
    # a group much larger than its share spills over to other workers
    q = SessionPlacement(PlacementConfig(epsilon=0.25), URLS, clock=Clock())
    members = [turn(q, f"h-{i}", 0, 1000, group="h").worker for i in range(16)]
    assert len(set(members)) > 1


def test_group_affinity_off_spreads_the_group():
    p = SessionPlacement(PlacementConfig(groups="apart"), URLS, clock=Clock())
    members = {turn(p, f"g-{i}", 0, 1000, group="g").worker for i in range(4)}
    assert len(members) == 4


def test_an_overloaded_worker_moves_a_session_off_it_and_counts_the_move():
    p = SessionPlacement(PlacementConfig(move_epsilon=0.5, groups="apart"), URLS, clock=Clock())
    first = {f"s{i}": turn(p, f"s{i}", 0, 1000, env="long" if i == 0 else "short") for i in range(8)}
    hot = first["s0"].worker
    partner = next(sid for sid, r in first.items() if sid != "s0" and r.worker == hot)
    turn(p, "s0", 1, 30_000, env="long")  # s0 grows: its worker passes (1 + 0.5) x mean
    moved = turn(p, partner, 1, 1200, env="short")
    assert moved.moved and moved.worker != hot  # the small neighbour leaves (one cheap prefill)
    stays = turn(p, "s0", 2, 30_500, env="long")
    assert not stays.moved and stays.worker == hot  # moving s0 itself would only move the load
    assert p.moves_by_reason == {"overload": 1}


def test_a_removed_worker_moves_only_its_sessions():
    p = SessionPlacement(PlacementConfig(groups="apart"), URLS, clock=Clock())
    first = {f"s{i}": turn(p, f"s{i}", 0, 2000) for i in range(8)}
    gone = first["s0"].url
    p.set_workers([u for u in URLS if u != gone])  # indices of the later workers shift down
    for sid, r in first.items():
        nxt = turn(p, sid, 1, 2100)
        if r.url == gone:
            assert nxt.moved and nxt.url != gone
        else:
            assert not nxt.moved and nxt.url == r.url  # same worker, even under a new index
            assert p.workers[nxt.worker].url == r.url
    assert p.moves_by_reason == {"worker_gone": sum(1 for r in first.values() if r.url == gone)}


def test_a_refused_target_is_re_placed_and_kept_out_for_a_while():
    clock = Clock()
    p = SessionPlacement(PlacementConfig(quarantine_s=10.0), URLS, clock=clock)
    r = p.choose(Call("s", "e", None, 0, 1000, 10))
    retry = r.retry()
    assert retry.worker != r.worker and retry.moved
    retry.done(0, 10)
    for i in range(6):
        assert turn(p, f"n{i}", 0, 1000).worker != r.worker
    clock.t = 11.0
    assert any(turn(p, f"m{i}", 0, 1000).worker == r.worker for i in range(6))
    assert p.refusals == 1


def test_unhealthy_workers_get_no_calls_and_the_header_counts_healthy_workers_only():
    """sglang-router 0.3.2 indexes X-SMG-Target-Worker among the workers it holds healthy."""
    p = SessionPlacement(PlacementConfig(), URLS, clock=Clock())
    p.set_workers(URLS, healthy=[True, False, True, True])
    routes = [turn(p, f"s{i}", 0, 1000) for i in range(9)]
    assert all(r.worker != 1 for r in routes)
    for r in routes:
        assert r.call_headers()["X-SMG-Target-Worker"] == str({0: 0, 2: 1, 3: 2}[r.worker])


def test_pools_keep_long_environments_apart():
    p = SessionPlacement(
        PlacementConfig(pools=True, long_context_tokens=8000, groups="apart"), URLS, clock=Clock()
    )
    # observed traffic: one env with long contexts, one with short ones
    for i in range(4):
        turn(p, f"warm-long-{i}", 0, 30_000, env="swe")
        turn(p, f"warm-short-{i}", 0, 1000, env="math")
    long_workers = {turn(p, f"L{i}", 0, 30_000, env="swe").worker for i in range(6)}
    short_workers = {turn(p, f"S{i}", 0, 1000, env="math").worker for i in range(6)}
    assert long_workers.isdisjoint(short_workers)
    assert p.snapshot()["envs"]["swe"]["long"] and not p.snapshot()["envs"]["math"]["long"]


def test_ended_and_idle_sessions_stop_counting_as_load():
    clock = Clock()
    p = SessionPlacement(PlacementConfig(session_idle_s=60.0), URLS, clock=clock)
    turn(p, "a", 0, 10_000)
    turn(p, "b", 0, 10_000)
    p.ended("a")
    assert sum(w["load_tokens"] for w in p.snapshot()["workers"]) == 10_100
    clock.t = 100.0
    turn(p, "c", 0, 1000)  # b has been idle for 100 s > 60 s
    assert p.snapshot()["sessions_live"] == 1
    assert p.snapshot()["envs"]["e"]["sessions_ended"] == 2


def test_the_snapshot_reports_per_env_traffic():
    p = SessionPlacement(PlacementConfig(), URLS, clock=Clock())
    r = p.choose(Call("s", "math", "g", 0, 1000, 50))
    r.done(cached_tokens=600, output_tokens=50)
    snap = p.snapshot()
    assert snap["envs"]["math"] == {
        "sessions": 1,
        "sessions_ended": 0,
        "mean_turns": None,
        "calls": 1,
        "mean_prompt_tokens": 1000,
        "mean_context_tokens": 1050,
        "cache_hit_rate": 0.6,
        "long": False,
    }
    assert snap["workers"][r.worker]["cache_hit_rate"] == 0.6


def test_headers_keep_the_routing_key_and_add_the_target():
    p = SessionPlacement(PlacementConfig(), URLS, clock=Clock())
    r = p.choose(Call("sess-1", "e", None, 0, 10, 1))
    assert r.call_headers() == {"X-SMG-Routing-Key": "sess-1", "X-SMG-Target-Worker": str(r.worker)}


def test_bad_config_and_no_workers_are_clear_errors():
    with pytest.raises(ValueError, match="epsilon"):
        PlacementConfig(epsilon=-1)
    with pytest.raises(LookupError, match="no engine workers"):
        SessionPlacement(PlacementConfig(), []).choose(Call("s", "e", None, 0, 1, 1))


def _env_prefix_spread(new_sessions: str) -> tuple[set[int], list[float]]:
    """Four workers each holding eight sessions of one env, then four sessions of a new env "x"."""
    p = SessionPlacement(PlacementConfig(groups="apart", new_sessions=new_sessions), URLS, clock=Clock())
    for i in range(32):
        turn(p, f"base{i}", 0, 1000, out=0, env="base")
    workers = {turn(p, f"x{i}", 0, 1000, out=0, env="x").worker for i in range(4)}
    return workers, [w.load for w in p.workers]


def test_env_prefix_places_new_sessions_where_their_env_already_is_within_bounds():
    spread, _ = _env_prefix_spread("least_loaded")
    together, loads = _env_prefix_spread("env_prefix")
    assert len(spread) == 4  # least loaded: one per worker, the env's shared prompt prefilled four times
    assert len(together) == 2  # a worker that holds "x" takes the next "x" while within 1.25 x mean
    assert max(loads) <= 1.25 * sum(loads) / len(loads)


def test_env_prefix_keeps_the_load_bound_and_counts_sessions_per_env():
    p = SessionPlacement(PlacementConfig(groups="apart", new_sessions="env_prefix"), URLS, clock=Clock())
    routes = [turn(p, f"s{i}", 0, 1000, out=0, env="only") for i in range(40)]
    loads = [w.load for w in p.workers]
    assert max(loads) <= 1.25 * sum(loads) / len(loads)
    snap = p.snapshot()
    assert sum(w["sessions_by_env"].get("only", 0) for w in snap["workers"]) == 40
    p.ended(routes[0].session)
    assert sum(w["sessions_by_env"].get("only", 0) for w in p.snapshot()["workers"]) == 39
    assert snap["config"]["new_sessions"] == "env_prefix"


def test_env_prefix_still_places_a_group_on_its_first_members_worker():
    p = SessionPlacement(PlacementConfig(new_sessions="env_prefix"), URLS, clock=Clock())
    for i in range(32):
        turn(p, f"base{i}", 0, 1000, out=0, env="base", group=f"b{i}")
    first = turn(p, "g-0", 0, 1000, out=0, env="e", group="g")
    assert turn(p, "g-1", 0, 1000, out=0, env="e", group="g").worker == first.worker


def test_an_unknown_new_sessions_value_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="new_sessions must be 'least_loaded' or 'env_prefix'"):
        PlacementConfig(new_sessions="nearest")  # type: ignore[arg-type]
