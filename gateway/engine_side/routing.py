"""How the gateway's engine calls are routed, and what it learns about each environment's traffic.

`EngineRouting` sits between the turn core (`service.py`) and the engine client: per call it gives
the routing headers (`CallRoute.call_headers()`), and when the call answers it counts the environment's
traffic. With `placement` off the headers are `X-SMG-Routing-Key: <session>` for sglang-router's
consistent hashing; with it on, `gateway/engine_side/placement.py` also chooses
`X-SMG-Target-Worker` from the router's worker list, which a background task re-reads from the
router's `GET /workers` every few seconds (and before re-placing a refused call). The engine client
asks for a new route only when the router refused the target before anything was generated, so
the tokens of a call never depend on routing (docs/routing.md).

`placement.enabled: auto` (the default) is decided by the first answer of `GET /workers`: a worker
list (an sglang-router, the `palaestra train` path) turns placement on; any other answer below 500
(one engine, a plain SGLang server: 404) turns it off for good, with one info log line, and calls
carry the routing key only, as with `off`. Until an answer comes (the URL not up yet) calls carry
the routing key and the list is asked again every few seconds.

Also here: per-environment counters in /metrics (`palaestra_gateway_routing_*`), the JSON of
`GET /admin/routing`, and the optional routing record (`routing_trace`: one JSON line per engine
call, what `bench/routing.py --trace` replays).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from palaestra.gateway.engine_side.placement import (
    ROUTING_HEADER,
    Call,
    PlacementConfig,
    Route,
    SessionPlacement,
)
from palaestra.gateway.metrics import Children

__all__ = ["CallRoute", "EngineRouting", "RoutingOptions"]

log = logging.getLogger("palaestra.gateway.engine_side.routing")


@dataclass(frozen=True)
class RoutingOptions:
    """The routing part of the gateway's options (GatewayOptions.placement, routing_trace)."""

    placement: PlacementConfig = PlacementConfig()
    routing_trace: str | None = None
    refresh_s: float = 2.0
    direct: bool = False
    """Calls go to the placed worker's own URL, not through the router: rollout routing replay needs
    it, because sglang-router 0.3.2's typed /generate drops `return_routed_experts` (measured; the
    router still gives the worker list, and placement keeps each session on its worker)."""


class CallRoute:
    """The routing of one engine call: its headers, a retry after a refused target, its outcome."""

    __slots__ = ("_env", "_owner", "_prompt_ids", "_route", "_session", "_started", "_turn", "group")

    def __init__(
        self,
        owner: EngineRouting,
        session: str,
        env: str,
        group: str | None,
        turn: int,
        prompt_ids: Sequence[int],
        route: Route | None,
    ) -> None:
        self._owner = owner
        self._session = session
        self._env = env
        self.group = group
        self._turn = turn
        self._prompt_ids = prompt_ids
        self._route = route
        self._started = time.monotonic()

    def call_headers(self) -> dict[str, str]:
        return self._route.call_headers() if self._route is not None else {ROUTING_HEADER: self._session}

    @property
    def url(self) -> str | None:
        """The worker's own URL when calls bypass the router (`RoutingOptions.direct`), else None."""
        return self._route.url if self._route is not None and self._owner.options.direct else None

    @property
    def worker(self) -> int | None:
        return self._route.worker if self._route is not None else None

    async def retry(self, reason: str = "refused") -> bool:
        """The router refused the target before generating (`refused`), or its engine answered the
        call with an error (`engine_error`: nothing of it is kept): re-read the worker list, re-place
        the call on another worker and say so (True); False with placement off (the caller retries
        as it always did, where the router sends it)."""
        if self._route is None:
            return False
        await self._owner.refresh_workers()
        self._route = self._route.retry(engine_error=reason == "engine_error")
        self._owner.moves.labels(reason=reason).inc()
        return True

    def done(self, cached_tokens: int, output_tokens: int) -> None:
        engine_s = time.monotonic() - self._started
        if self._route is not None:
            if self._route.moved:
                self._owner.moves.labels(reason="placement").inc()
            self._route.done(cached_tokens, output_tokens)
        self._owner.answered(self, cached_tokens, output_tokens, engine_s)

    def failed(self) -> None:
        if self._route is not None:
            self._route.abandoned()


class EngineRouting:
    """One per gateway: routes calls (see the module docstring) and keeps per-env statistics."""

    def __init__(
        self,
        options: RoutingOptions,
        engine_url: str,
        registry: CollectorRegistry,
        serves: Callable[[str], bool] | None = None,
    ) -> None:
        self.options = options
        # whether the engine client can post to a URL (`BareHttp.serves`): with `direct`, the workers'
        # URLs from the router are checked against it (an https:// one and gateway.engine_http: bare)
        self.serves = serves
        self.engine_url = engine_url.rstrip("/")
        self.placement: SessionPlacement | None = (
            SessionPlacement(options.placement)
            if options.placement.enabled != "off" or options.direct
            else None
        )
        # `auto`, not yet decided: the first answer of GET /workers turns placement on or off
        self.undecided = options.placement.enabled == "auto" and not options.direct
        self._calls: dict[str, int] = {}  # session -> engine calls so far (its turn index)
        self._first_prompt: OrderedDict[str, Sequence[int]] = OrderedDict()  # env / group -> its first prompt
        self._record: TextIO | None = None
        if options.routing_trace:
            path = Path(options.routing_trace)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._record = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._task: asyncio.Task | None = None
        self.workers_error: str | None = None
        self._unserved_logged: str | None = None
        p = "palaestra_gateway_routing"
        self.calls = Counter(
            f"{p}_calls", "Engine calls answered, by environment", ["env"], registry=registry
        )
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens", "Prompt tokens sent, by environment", ["env"], registry=registry
        )
        self.cached_tokens = Counter(
            f"{p}_cached_tokens",
            "Prompt tokens the engines reported served from their prefix cache, by environment",
            ["env"],
            registry=registry,
        )
        self.output_tokens = Counter(
            f"{p}_output_tokens", "Tokens sampled, by environment", ["env"], registry=registry
        )
        self.sessions = Counter(
            f"{p}_sessions", "Sessions that made an engine call, by environment", ["env"], registry=registry
        )
        self.moves = Counter(
            f"{p}_moves",
            "Calls the placement layer sent to another worker than the session's (placement: overload or a "
            "worker gone; refused: the router refused the target; engine_error: the engine failed the call; "
            "unreachable: a worker called directly, for routing replay, refused the connection)",
            ["reason"],
            registry=registry,
        )
        self.worker_count = Gauge(f"{p}_workers", "Workers the placement layer knows", registry=registry)
        self._env_totals: dict[str, dict[str, float]] = {}
        # each counter's child per env, looked up once (`labels` checks and locks on every call)
        self._env_calls, self._env_prompt, self._env_cached, self._env_output = map(
            Children, (self.calls, self.prompt_tokens, self.cached_tokens, self.output_tokens)
        )

    # -- the call path ------------------------------------------------------------------------
    async def admit(
        self, session: str, env: str, group: str | None, prompt_ids: Sequence[int], max_new: int
    ) -> None:
        """A new session's first call may wait for room (placement's admit_fill); others return at once."""
        if self.placement is not None and self.placement.config.admit_fill and session not in self._calls:
            await self.placement.admit(Call(session, env, group, 0, len(prompt_ids), max_new))

    def route(
        self, session: str, env: str, group: str | None, prompt_ids: Sequence[int], max_new_tokens: int
    ) -> CallRoute:
        turn = self._calls.get(session, 0)
        self._calls[session] = turn + 1
        if turn == 0:
            self.sessions.labels(env=env).inc()
        route = None
        if self.placement is not None and self.placement.workers:
            route = self.placement.choose(Call(session, env, group, turn, len(prompt_ids), max_new_tokens))
        return CallRoute(self, session, env, group, turn, prompt_ids, route)

    def answered(self, call: CallRoute, cached: int, output: int, engine_s: float) -> None:
        env = call._env
        prompt = len(call._prompt_ids)
        self._env_calls(env).inc()
        self._env_prompt(env).inc(prompt)
        self._env_cached(env).inc(cached)
        self._env_output(env).inc(output)
        t = self._env_totals.setdefault(
            env, {"calls": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
        )
        t["calls"] += 1
        t["prompt_tokens"] += prompt
        t["cached_tokens"] += cached
        t["output_tokens"] += output
        if self._record is not None:
            self._write(call, cached, output, engine_s)

    def ended(self, session: str) -> None:
        """The session finished: it no longer needs its worker's cache."""
        self._calls.pop(session, None)
        if self.placement is not None:
            self.placement.ended(session)

    async def refresh_workers(self) -> None:
        """Reads the router's worker list now (after a refused target: its health view changed)."""
        if self.placement is None:
            return
        async with aiohttp.ClientSession(trust_env=False) as http:
            await self._refresh(http)

    # -- the routing record ---------------------------------------------------------------------
    def _shared(self, key: str, ids: Sequence[int]) -> int:
        """Length of the common prefix of `ids` with the first prompt seen under `key`."""
        first = self._first_prompt.get(key)
        if first is None:
            self._first_prompt[key] = ids
            if len(self._first_prompt) > 4096:
                self._first_prompt.popitem(last=False)
            return len(ids)
        self._first_prompt.move_to_end(key)
        n = min(len(first), len(ids))
        i = 0
        while i < n and first[i] == ids[i]:
            i += 1
        return i

    def _write(self, call: CallRoute, cached: int, output: int, engine_s: float) -> None:
        row: dict[str, Any] = {
            "t": round(time.time() - engine_s, 4),
            "session": call._session,
            "env": call._env,
            "group": call.group,
            "turn": call._turn,
            "prompt_tokens": len(call._prompt_ids),
            "cached_tokens": cached,
            "output_tokens": output,
            "engine_s": round(engine_s, 4),
            "worker": call.worker,
        }
        if call._turn == 0:
            row["shared_env"] = self._shared(f"env:{call._env}", call._prompt_ids)
            if call.group:
                row["shared_group"] = self._shared(f"group:{call.group}", call._prompt_ids)
        assert self._record is not None
        self._record.write(json.dumps(row) + "\n")

    # -- the router's worker list -----------------------------------------------------------------
    async def start(self) -> None:
        """Starts re-reading the router's worker list (placement on only); the first read is awaited."""
        if self.placement is None:
            return
        async with aiohttp.ClientSession(trust_env=False) as http:
            await self._refresh(http)
        if self.placement is not None and (unserved := self._unserved()) is not None:
            raise ValueError(unserved)  # at start, before any call: one line naming the option and the URL
        if self.placement is not None:  # `auto` may have found no router
            self._task = asyncio.create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        async with aiohttp.ClientSession(trust_env=False) as http:
            while self.placement is not None:
                await asyncio.sleep(self.options.refresh_s)
                await self._refresh(http)

    async def _refresh(self, http: aiohttp.ClientSession) -> None:
        assert self.placement is not None
        try:
            async with http.get(f"{self.engine_url}/workers", timeout=aiohttp.ClientTimeout(total=5)) as r:
                status = r.status
                data = await r.json(content_type=None) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._workers_unknown(f"GET {self.engine_url}/workers failed: {exc!r}")
            return
        workers = (data or {}).get("workers") if isinstance(data, dict) else None
        if status != 200 or not isinstance(workers, list):
            if self.undecided and status < 500:
                self._no_router(status)
                return
            self._workers_unknown(
                f"GET {self.engine_url}/workers answered {status}: the engine URL is not an sglang-router "
                "listing its workers, so there is nothing to place (calls carry the routing key only); "
                "point the engine URL at the router, or set gateway.placement.enabled=auto "
                "(--placement-enabled auto) or off"
            )
            return
        if self.undecided:
            self.undecided = False
            log.info("placement on: %s/workers lists %d worker(s)", self.engine_url, len(workers))
        urls = [str(w.get("url")) for w in workers]
        healthy = [bool(w.get("is_healthy", True)) for w in workers]
        if urls != [w.url for w in self.placement.workers] or healthy != [
            w.healthy for w in self.placement.workers
        ]:
            self.placement.set_workers(urls, healthy)
        if self.placement.config.admit_fill:
            for w in self.placement.workers:
                if w.capacity is None and w.healthy:
                    self.placement.set_capacity(w.url, await self._capacity(http, w.url))
        self.worker_count.set(len(urls))
        self.workers_error = None
        unserved = self._unserved() if self._task is not None else None  # at start: start() raises it
        if unserved is not None and unserved != self._unserved_logged:
            self._unserved_logged = unserved  # a worker listed after start: its calls fail naming the option
            log.error("placement: %s", unserved)

    def _unserved(self) -> str | None:
        """The error for a worker URL the engine client cannot post to when calls go to the workers
        directly (routing replay): the bare client and an https:// worker; None when there is none."""
        if not self.options.direct or self.serves is None or self.placement is None:
            return None
        for w in self.placement.workers:
            if not self.serves(w.url):
                return (
                    f"gateway.engine_http is bare, which speaks plain http:// only, but the router lists "
                    f"the worker {w.url} and routing replay posts to the workers directly: set "
                    "gateway.engine_http to auto or aiohttp"
                )
        return None

    @staticmethod
    async def _capacity(http: aiohttp.ClientSession, url: str) -> int | None:
        """A worker's KV capacity in tokens: SGLang's /server_info max_total_num_tokens."""
        try:
            async with http.get(
                f"{url.rstrip('/')}/server_info", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
            return int(info["max_total_num_tokens"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None

    def _workers_unknown(self, message: str) -> None:
        if message != self.workers_error:
            if self.undecided:  # `auto` waits for an answer, routing as with placement off meanwhile
                log.info(
                    "placement (auto) undecided, asked again in %.0f s: %s", self.options.refresh_s, message
                )
            else:
                log.warning("placement: %s", message)
        self.workers_error = message

    def _no_router(self, status: int) -> None:
        """`auto` and the engine URL answered GET /workers without a worker list: placement off."""
        self.undecided = False
        self.placement = None
        self.workers_error = None
        log.info(
            "placement off: GET %s/workers answered %d, so the engine URL is one engine, not a router "
            "listing its workers; calls carry the routing key only (gateway.placement.enabled=auto)",
            self.engine_url,
            status,
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._record is not None:
            self._record.close()
            self._record = None

    # -- GET /admin/routing -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        envs = {
            env: {
                **{k: int(v) for k, v in t.items()},
                "cache_hit_rate": round(t["cached_tokens"] / t["prompt_tokens"], 4)
                if t["prompt_tokens"]
                else None,
            }
            for env, t in sorted(self._env_totals.items())
        }
        out: dict[str, Any] = {
            "mode": "direct"
            if self.options.direct
            else "placement"
            if self.placement is not None and not self.undecided
            else "routing_key",
            "placement_enabled": self.options.placement.enabled,
            "router": self.engine_url,
            "routing_trace": self.options.routing_trace,
            "traffic": envs,
        }
        if self.placement is not None:
            out["workers_error"] = self.workers_error
            out["placement"] = self.placement.snapshot()
        return out
