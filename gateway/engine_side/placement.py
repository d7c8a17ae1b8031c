"""Workload-aware placement: which engine worker each call goes to, chosen from what the gateway knows.

sglang-router stays the engine-facing router; this module only chooses the headers of a call. With
placement off every call carries `X-SMG-Routing-Key: <session>` and the router's
`consistent_hashing` picks the worker. With it on (the default wherever the engine URL is a router
that lists its workers: `enabled: auto`, decided in `routing.py`; docs/routing.md has the
measurements), a call also carries `X-SMG-Target-Worker: <index>`, which the same policy honours
first. In sglang-router 0.3.2 (measured, tests/engine/test_sim.py) the index counts the workers the
router holds healthy, in its `GET /workers` order; an index past them is a 503
`no_available_workers`, and a target that died before the router noticed is a 500
`call_upstream_request_error`: in both cases nothing was generated, so the call is re-placed and
retried. When the router's health view changes, the indices of the workers after the changed one
shift until the next read of `GET /workers` (a few seconds): calls may reach a neighbour meanwhile,
which costs a prefill, never a token.

What it uses, per call: the session's environment, group, turn and prompt length; per worker, the
sessions it holds and their contexts (the KV they need to stay cached), the calls in flight and
the prefix-cache hits the engine reports (`meta_info.cached_tokens`). The policy:

* **affinity with bounded load**: a session stays on its worker (its prefix cache) until that
  worker's load passes `(1 + move_epsilon) x mean`; then it moves and pays one prefill. A worker
  that is removed or fails moves its sessions the same way;
* a new session goes to the least loaded worker, where a session's load is its current context or
  its environment's mean context per call, whichever is larger (a long agent session weighs what
  it will grow to, not its first prompt); with `new_sessions: env_prefix`, to the least loaded of
  the workers already holding sessions of its environment (whose cache holds the environment's
  shared prompt: a system prompt, tool list, repository context) while that worker stays within
  `(1 + epsilon) x mean`, so the shared prompt is prefilled on as few workers as the load allows;
* **group placement**: the sessions of a group (GRPO: the same prompt) join the first one's worker
  while it is within `(1 + epsilon) x mean`, so their shared prompt is prefilled once;
* optional **pools**: environments whose mean context is above `long_context_tokens` get their own
  workers, sized from their share of the load, so long sessions and short bursts do not share a
  batch.

Tokens never depend on any of this: the body of a call is not touched, only its routing headers.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Call", "SessionPlacement", "PlacementConfig", "Route", "TARGET_HEADER"]

TARGET_HEADER = "X-SMG-Target-Worker"
ROUTING_HEADER = "X-SMG-Routing-Key"


@dataclass(frozen=True)
class PlacementConfig:
    """How sessions are placed (docs/routing.md explains each knob and shows what it measured): the
    ``gateway.placement`` section of a run config, flags ``--placement-<field>`` of the gateway."""

    enabled: Literal["auto", "on", "off"] = "auto"
    """Workload-aware placement: choose each engine call's worker (X-SMG-Target-Worker) from the
    session's env, group, turns and context and each worker's load. auto = on when the engine URL
    answers GET /workers with a worker list (an sglang-router), else off with one info log line
    (one engine, a plain SGLang server); on = place (a warning if the URL lists no workers); off =
    the router's consistent_hashing on the session id alone. true / false read as on / off."""
    epsilon: float = 0.25
    """A new session joins its group's worker only while that worker is within (1 + epsilon) x mean load."""
    move_epsilon: float = 1.0
    """A session leaves its worker (and pays one prefill) when that load passes (1 + move_epsilon) x mean."""
    groups: Literal["together", "apart"] = "together"
    """together = a group's sessions share a worker while it is within bounds (their shared prompt is
    prefilled once); apart = each session is placed on its own."""
    new_sessions: Literal["least_loaded", "env_prefix"] = "least_loaded"
    """Where a session that does not join its group goes: least_loaded = the least loaded worker;
    env_prefix = the least loaded of the workers already holding live sessions of its environment
    (their caches hold the environment's shared prompt) while that worker stays within
    (1 + epsilon) x mean load, else the least loaded worker."""
    pools: bool = False
    """Separate workers for long-context environments and the rest, sized from their load shares."""
    long_context_tokens: int = 8192
    """With pools: an environment is long when its mean context per call is above this."""
    session_idle_s: float = 600.0
    """A session with no call for this long stops counting as load on its worker."""
    quarantine_s: float = 10.0
    """A worker the router refused (503) gets no new calls for this long, unless it is listed healthy."""
    admit_fill: float = 0.0
    """A new session's first call waits while placing it would fill every worker past this fraction
    of its KV capacity (the engines' max_total_num_tokens), counting each session at its context or
    its environment's mean context: a concurrency limit per environment derived from its traffic.
    0 = never wait."""
    admit_wait_s: float = 60.0
    """The longest a new session waits for room; then it is placed anyway."""

    def __post_init__(self) -> None:
        if isinstance(self.enabled, bool):  # `enabled: true` of earlier configs and callers
            object.__setattr__(self, "enabled", "on" if self.enabled else "off")
        if self.enabled not in ("auto", "on", "off"):
            raise ValueError(
                f"placement enabled must be 'auto', 'on' or 'off' (got {self.enabled!r}); auto = on where "
                "the engine URL is a router listing its workers"
            )
        for name in (
            "epsilon",
            "move_epsilon",
            "session_idle_s",
            "quarantine_s",
            "admit_fill",
            "admit_wait_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"placement {name} must be >= 0 (got {getattr(self, name)})")
        if self.long_context_tokens < 1:
            raise ValueError("placement long_context_tokens must be >= 1")
        if self.groups not in ("together", "apart"):
            raise ValueError(f"placement groups must be 'together' or 'apart' (got {self.groups!r})")
        if self.new_sessions not in ("least_loaded", "env_prefix"):
            raise ValueError(
                f"placement new_sessions must be 'least_loaded' or 'env_prefix' (got {self.new_sessions!r})"
            )

    @property
    def group_affinity(self) -> bool:
        return self.groups == "together"


@dataclass(frozen=True)
class Call:
    """What the gateway knows about one engine call."""

    session: str
    env: str
    group: str | None
    turn: int
    prompt_tokens: int
    max_new_tokens: int = 0


@dataclass
class Route:
    """Where one call goes; `headers()` are what the engine client sends."""

    session: str
    worker: int  # index into the router's worker list
    url: str
    moved: bool = False
    target: int = 0  # the header's index: the worker's rank among the workers the router holds healthy
    placement: SessionPlacement | None = field(default=None, repr=False)
    _call: Call | None = field(default=None, repr=False)

    def call_headers(self) -> dict[str, str]:
        return {ROUTING_HEADER: self.session, TARGET_HEADER: str(self.target)}

    def retry(self, engine_error: bool = False) -> Route:
        """The router refused this worker (503 before anything was generated), or with `engine_error`
        its engine answered the call with an error (nothing kept): a new route."""
        assert self.placement is not None and self._call is not None
        self.placement.refused(self, engine_error)
        return self.placement.choose(self._call)

    def done(self, cached_tokens: int, output_tokens: int) -> None:
        if self.placement is not None:
            self.placement.finished(self, cached_tokens, output_tokens)

    def abandoned(self) -> None:
        """The call failed some other way: only its in-flight count is released."""
        if self.placement is not None:
            self.placement.released(self)


@dataclass
class _Session:
    env: str
    group: str | None
    worker: int | None = None
    url: str | None = None
    context: int = 0
    calls: int = 0
    last: float = 0.0
    workers_seen: int = 0
    applied: float = 0.0  # the weight counted in its worker's load


@dataclass
class _Worker:
    url: str
    load: float = 0.0  # sum of its live sessions' weights
    sessions: int = 0
    inflight: int = 0
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    refused_until: float = 0.0
    healthy: bool = True
    capacity: int | None = None  # KV tokens (the engine's max_total_num_tokens), when known
    envs: dict[str, int] = field(default_factory=dict)  # env -> its live sessions here


@dataclass
class _EnvStats:
    sessions: int = 0
    ended: int = 0
    turns_ended: int = 0
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    context_sum: int = 0

    @property
    def mean_context(self) -> float:
        return self.context_sum / self.calls if self.calls else 0.0


class SessionPlacement:
    """Chooses a worker per call (see the module docstring); one instance per gateway.

    Not thread-safe: it is used from the gateway's event loop, between awaits. `clock` is for tests.
    """

    def __init__(
        self,
        config: PlacementConfig,
        worker_urls: Sequence[str] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        time_scale: float = 1.0,
    ) -> None:
        self.config = config
        self.clock = clock
        self.time_scale = time_scale  # wall seconds per `clock` second (the bench's scaled clock)
        self._changed: asyncio.Event | None = None
        self._next_expire = 0.0
        self.admitted_after_wait = 0
        self.admit_timeouts = 0
        self.admit_wait_s = 0.0
        self.workers: list[_Worker] = []
        self.sessions: dict[str, _Session] = {}
        self.groups: dict[str, int] = {}  # group -> worker index of its first session
        self.envs: dict[str, _EnvStats] = {}
        self.moves = 0
        self.moves_by_reason: dict[str, int] = {}
        self.refusals = 0
        self.engine_errors = 0  # calls an engine answered with an error (5xx) and that were moved off it
        self.pool_long: set[int] = set()
        self.set_workers(worker_urls)

    # -- workers --------------------------------------------------------------------------------
    def set_workers(self, urls: Sequence[str], healthy: Sequence[bool] | None = None) -> None:
        """The router's worker list, in its index order. Sessions on a worker that left are
        re-placed at their next call (a move); the load of the others is kept by URL."""
        if healthy is None:
            healthy = [True] * len(urls)
        old = {w.url: w for w in self.workers}
        self.workers = []
        for url, ok in zip(urls, healthy, strict=True):
            w = old.get(url) or _Worker(url)
            w.healthy = bool(ok)
            self.workers.append(w)
        index = {w.url: i for i, w in enumerate(self.workers)}
        for s in self.sessions.values():
            if s.url is not None:
                s.worker = index.get(s.url)  # None: its worker left; re-placed at the next call
        self.groups = {g: i for g, i in self.groups.items() if i < len(self.workers)}
        self._recompute_loads()
        self._notify()

    def set_capacity(self, url: str, tokens: int | None) -> None:
        """A worker's KV capacity in tokens (None: unknown, never waited for)."""
        for w in self.workers:
            if w.url == url:
                w.capacity = tokens
        self._notify()

    # -- admission: a concurrency limit derived from the traffic --------------------------------
    def _has_room(self, call: Call) -> bool:
        now = self.clock()
        usable = [i for i in range(len(self.workers)) if self._usable(i, now)] or list(
            range(len(self.workers))
        )
        env = self._env(call.env)
        weight = float(max(call.prompt_tokens, env.mean_context, 1))
        fill = self.config.admit_fill
        for i in self._pool(call.env, usable):
            w = self.workers[i]
            if w.capacity is None or w.load + weight <= fill * w.capacity:
                return True
        return False

    async def admit(self, call: Call) -> float:
        """Before a new session's first call: waits until a worker has room for it (`admit_fill`)
        or `admit_wait_s` passed; returns the seconds waited (by `clock`). Later calls never wait."""
        if not self.config.admit_fill or not self.workers or call.session in self.sessions:
            return 0.0
        start = self.clock()
        waited = False
        while not self._has_room(call):
            left = self.config.admit_wait_s - (self.clock() - start)
            if left <= 0:
                self.admit_timeouts += 1
                break
            waited = True
            if self._changed is None:
                self._changed = asyncio.Event()
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), left * self.time_scale)
            except TimeoutError:
                pass
        spent = self.clock() - start
        if waited:
            self.admitted_after_wait += 1
            self.admit_wait_s += spent
        return spent

    def _notify(self) -> None:
        """Load went down somewhere: waiting sessions look again."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _usable(self, i: int, now: float) -> bool:
        w = self.workers[i]
        return w.healthy and w.refused_until <= now

    # -- the decision ---------------------------------------------------------------------------
    def choose(self, call: Call) -> Route:
        """The route of one call; raises LookupError when no worker is known."""
        if not self.workers:
            raise LookupError("no engine workers are known to the placement layer")
        now = self.clock()
        self._expire(now)
        s = self.sessions.get(call.session)
        if s is None:
            s = self.sessions[call.session] = _Session(call.env, call.group)
            self._env(call.env).sessions += 1
        prev = self._current(s)
        if prev is not None:
            self._unassign(s)  # decided without its own weight, then added back
        s.last = now
        s.context = max(s.context, call.prompt_tokens)
        usable = [i for i in range(len(self.workers)) if self._usable(i, now)] or list(
            range(len(self.workers))
        )
        reason = None
        if prev is not None and prev in usable:
            target = prev
            if self._overloaded(prev, usable, self._weight(s)):
                candidates = [i for i in self._pool(s.env, usable) if i != prev]
                if candidates:
                    best = self._least_loaded(candidates, call.session)
                    if self.workers[best].load < self.workers[prev].load:
                        target, reason = best, "overload"
        else:
            if s.url is not None:
                reason = "worker_gone"  # removed from the router's list, refused or unhealthy
            target = self._place_new(s, call, usable)
        if reason is not None:
            self.moves += 1
            self.moves_by_reason[reason] = self.moves_by_reason.get(reason, 0) + 1
        if s.url != self.workers[target].url:
            s.workers_seen += 1
        s.worker, s.url = target, self.workers[target].url
        self._assign(s)
        w = self.workers[target]
        w.inflight += 1
        rank = sum(1 for j in range(target) if self.workers[j].healthy)
        return Route(call.session, target, w.url, reason is not None, target=rank, placement=self, _call=call)

    def _current(self, s: _Session) -> int | None:
        """The session's worker index, if that worker is still in the list under the same URL."""
        i = s.worker
        if i is not None and i < len(self.workers) and self.workers[i].url == s.url:
            return i
        return None

    def _place_new(self, s: _Session, call: Call, usable: list[int]) -> int:
        pool = self._pool(s.env, usable)
        g = self.groups.get(s.group) if (self.config.group_affinity and s.group is not None) else None
        if g is not None and g in pool and self._fits(g, self._weight(s), pool, self.config.epsilon):
            return g
        target = None
        if self.config.new_sessions == "env_prefix":
            target = self._env_holder(s, pool, call.session)
        if target is None:
            target = self._least_loaded(pool, call.session)
        if s.group is not None and (g is None or g not in usable):
            self.groups[s.group] = target  # the group's first (or surviving) worker
        return target

    def _env_holder(self, s: _Session, pool: Sequence[int], key: str) -> int | None:
        """The least loaded worker of `pool` already holding sessions of the session's environment
        (its shared prompt is in that worker's cache) and within (1 + epsilon) x mean with it added;
        None when there is none."""
        weight = self._weight(s)
        holders = [
            i
            for i in pool
            if self.workers[i].envs.get(s.env, 0) > 0 and self._fits(i, weight, pool, self.config.epsilon)
        ]
        return self._least_loaded(holders, key) if holders else None

    def _weight(self, s: _Session) -> float:
        """A session's load: its context, or its environment's mean context if that is larger."""
        return float(max(s.context, self._env(s.env).mean_context, 1))

    def _fits(self, i: int, extra: float, pool: Sequence[int], eps: float) -> bool:
        mean_after = (sum(self.workers[j].load for j in pool) + extra) / len(pool)
        return self.workers[i].load + extra <= (1 + eps) * mean_after

    def _overloaded(self, i: int, usable: Sequence[int], extra: float) -> bool:
        """Worker i, with `extra` more load, above (1 + move_epsilon) x its pool's mean."""
        pool = self._pool_of_worker(i, usable)
        if len(pool) < 2:
            return False
        mean = (sum(self.workers[j].load for j in pool) + extra) / len(pool)
        return self.workers[i].load + extra > (1 + self.config.move_epsilon) * mean

    def _least_loaded(self, candidates: Sequence[int], key: str) -> int:
        # ties broken by a hash of the session, so equal workers share new sessions evenly
        n = len(candidates)
        start = zlib.crc32(key.encode()) % n
        best = candidates[start]
        for k in range(1, n):
            i = candidates[(start + k) % n]
            if self.workers[i].load < self.workers[best].load:
                best = i
        return best

    # -- pools ----------------------------------------------------------------------------------
    def _is_long(self, env: str) -> bool:
        return self._env(env).mean_context > self.config.long_context_tokens

    def _pool(self, env: str, usable: Sequence[int]) -> list[int]:
        if not self.config.pools or len(usable) < 2:
            return list(usable)
        self._size_pools(usable)
        want_long = self._is_long(env)
        pool = [i for i in usable if (i in self.pool_long) == want_long]
        return pool or list(usable)

    def _pool_of_worker(self, i: int, usable: Sequence[int]) -> list[int]:
        if not self.config.pools or len(usable) < 2:
            return list(usable)
        in_long = i in self.pool_long
        return [j for j in usable if (j in self.pool_long) == in_long] or list(usable)

    def _size_pools(self, usable: Sequence[int]) -> None:
        """Long-context envs get a share of the workers equal to their share of the load (>= 1 each)."""
        total = long = 0.0
        for s in self.sessions.values():
            if s.worker is None:
                continue
            wgt = self._weight(s)
            total += wgt
            if self._is_long(s.env):
                long += wgt
        n = len(usable)
        k = min(n - 1, max(1, round(n * long / total))) if total and long else 0
        # the first k usable workers, stable while the share is stable
        self.pool_long = set(list(usable)[:k])

    # -- bookkeeping ----------------------------------------------------------------------------
    def _env(self, env: str) -> _EnvStats:
        st = self.envs.get(env)
        if st is None:
            st = self.envs[env] = _EnvStats()
        return st

    def _assign(self, s: _Session) -> None:
        assert s.worker is not None
        w = self.workers[s.worker]
        s.applied = self._weight(s)
        w.load += s.applied
        w.sessions += 1
        w.envs[s.env] = w.envs.get(s.env, 0) + 1

    def _unassign(self, s: _Session) -> None:
        assert s.worker is not None
        w = self.workers[s.worker]
        w.load = max(0.0, w.load - s.applied)
        w.sessions = max(0, w.sessions - 1)
        left = w.envs.get(s.env, 0) - 1
        if left > 0:
            w.envs[s.env] = left
        else:
            w.envs.pop(s.env, None)
        s.applied = 0.0

    def _recompute_loads(self) -> None:
        for w in self.workers:
            w.load, w.sessions = 0.0, 0
            w.envs.clear()
        for s in self.sessions.values():
            if self._current(s) is not None:
                self._assign(s)

    def _expire(self, now: float) -> None:
        idle = self.config.session_idle_s
        if not idle or now < self._next_expire:
            return
        self._next_expire = now + min(1.0, idle)  # a scan per second at most: O(sessions)
        stale = [sid for sid, s in self.sessions.items() if now - s.last > idle]
        for sid in stale:
            self.ended(sid)

    def finished(self, route: Route, cached_tokens: int, output_tokens: int) -> None:
        """A call answered: the session's context grows, the engine's cache report is counted."""
        self.released(route)
        s = self.sessions.get(route.session)
        call = route._call
        prompt = call.prompt_tokens if call is not None else 0
        st = self._env(s.env if s else (call.env if call else "unknown"))
        st.calls += 1
        st.prompt_tokens += prompt
        st.cached_tokens += cached_tokens
        st.output_tokens += output_tokens
        st.context_sum += prompt + output_tokens
        if route.worker < len(self.workers) and self.workers[route.worker].url == route.url:
            w = self.workers[route.worker]
            w.calls += 1
            w.prompt_tokens += prompt
            w.cached_tokens += cached_tokens
        if s is not None and self._current(s) is not None and s.url == route.url:
            s.context = prompt + output_tokens
            s.calls += 1
            w = self.workers[s.worker]
            weight = self._weight(s)
            w.load = max(0.0, w.load + weight - s.applied)
            s.applied = weight

    def released(self, route: Route) -> None:
        if route.worker < len(self.workers) and self.workers[route.worker].url == route.url:
            w = self.workers[route.worker]
            w.inflight = max(0, w.inflight - 1)

    def refused(self, route: Route, engine_error: bool = False) -> None:
        """The router answered 503 for this target, or (`engine_error`) its engine failed the call:
        keep new calls off it for a while."""
        if engine_error:
            self.engine_errors += 1
        else:
            self.refusals += 1
        self.released(route)
        if route.worker < len(self.workers) and self.workers[route.worker].url == route.url:
            self.workers[route.worker].refused_until = self.clock() + self.config.quarantine_s
        s = self.sessions.get(route.session)
        if s is not None and self._current(s) == route.worker and s.url == route.url:
            self._unassign(s)
            s.worker = None  # re-placed (a move) by the next choose()

    def ended(self, session: str) -> None:
        """The session finished (its reward was posted) or went idle: it no longer needs its cache."""
        s = self.sessions.pop(session, None)
        if s is None:
            return
        st = self._env(s.env)
        st.ended += 1
        st.turns_ended += s.calls
        if self._current(s) is not None:
            self._unassign(s)
        self._notify()

    # -- what /admin/routing shows --------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        loads = [w.load for w in self.workers]
        mean = sum(loads) / len(loads) if loads else 0.0
        return {
            "config": {k: getattr(self.config, k) for k in self.config.__dataclass_fields__},
            "workers": [
                {
                    "index": i,
                    "url": w.url,
                    "healthy": w.healthy,
                    "pool": ("long" if i in self.pool_long else "short") if self.config.pools else "all",
                    "sessions": w.sessions,
                    "sessions_by_env": dict(sorted(w.envs.items())),
                    "load_tokens": round(w.load),
                    "kv_capacity_tokens": w.capacity,
                    "inflight": w.inflight,
                    "calls": w.calls,
                    "cache_hit_rate": round(w.cached_tokens / w.prompt_tokens, 4)
                    if w.prompt_tokens
                    else None,
                }
                for i, w in enumerate(self.workers)
            ],
            "load_max_over_mean": round(max(loads) / mean, 3) if mean else None,
            "moves": self.moves,
            "moves_by_reason": dict(self.moves_by_reason),
            "admission": {
                "waited": self.admitted_after_wait,
                "timeouts": self.admit_timeouts,
                "wait_s_total": round(self.admit_wait_s, 3),
            },
            "refusals": self.refusals,
            "engine_errors": self.engine_errors,
            "sessions_live": len(self.sessions),
            "envs": {
                env: {
                    "sessions": st.sessions,
                    "sessions_ended": st.ended,
                    "mean_turns": round(st.turns_ended / st.ended, 2) if st.ended else None,
                    "calls": st.calls,
                    "mean_prompt_tokens": round(st.prompt_tokens / st.calls) if st.calls else None,
                    "mean_context_tokens": round(st.mean_context) if st.calls else None,
                    "cache_hit_rate": round(st.cached_tokens / st.prompt_tokens, 4)
                    if st.prompt_tokens
                    else None,
                    "long": self._is_long(env),
                }
                for env, st in sorted(self.envs.items())
            },
        }
