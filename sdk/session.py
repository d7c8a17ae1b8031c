"""Sessions: one episode of an environment, seen by the agent as an OpenAI endpoint.

    async with await gateway.session(env="math", task_id="t1", group_id="g") as session:
        reply = await session.client.chat.completions.create(model="policy", messages=[...])
        await session.reward(1.0, metrics={"correct": 1.0})

`session.client` is an `openai.AsyncOpenAI` bound to the session's base URL and holding the session's
own token (`session.api_key`, minted by the gateway's POST /sessions), which opens that session's
`/s/<id>/v1` routes and nothing else: never the environment key, which stays with the
`GatewayClient` that creates sessions and posts rewards. The agent needs nothing else but
`session.sampling`, the sampling settings the run chose (temperature, the episode's seed,
...), which it passes to every call: `create(model=..., messages=..., **session.sampling)`. Leaving the `async with` block by an exception closes the session as `failed` (its samples are
marked and the trainer drops them); leaving it without a reward closes it as `aborted`. An
environment whose episode cannot be judged for a reason that is not the agent's (the sandbox died
under it) raises `EpisodeFailed` with that reason: failed, never trained, and counted by reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai


class EpisodeFailed(RuntimeError):
    """The episode cannot be judged, for a reason that is not the agent's (its sandbox died under
    it): raised by a rollout, it closes the session as ``failed`` with ``failure/<reason>`` in the
    session's metrics, so its samples are never trained; the runner records `reason`
    (`RolloutResult.failure`) and a training run counts it (``rollout/failed_<reason>``). A wrong
    answer is a reward of 0, never this: raising it for the agent's own mistakes hides them from
    training."""

    def __init__(self, reason: str, detail: str = ""):
        if not reason or not reason.replace("_", "").isalnum():
            raise ValueError(
                f"EpisodeFailed: reason must be a short name like 'sandbox_error'; got {reason!r}"
            )
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def failed_metrics(exc: BaseException) -> dict[str, float]:
    """The metrics a session closed as failed by `exc` is recorded with."""
    return {"error": 1.0} | ({f"failure/{exc.reason}": 1.0} if isinstance(exc, EpisodeFailed) else {})


class GatewayError(RuntimeError):
    """The gateway refused a session call; `status` is the HTTP status (0: unreachable)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


TRANSIENT = {0, 429, 502, 503, 504}
GATEWAY_SAMPLING = frozenset(
    (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
    )
)
"""The `Session.sampling` keys the gateway holds for the session (gateway/sessions/sampling.py's
FIELDS) and applies to every call; any other key (e.g. `max_tokens`) stays the environment's to pass."""


def _retry_after(r: httpx.Response) -> float | None:
    """The `Retry-After` header in seconds (at least 0.1), or None when absent or not a number."""
    try:
        return max(0.1, float(r.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


@dataclass
class GatewayClient:
    """The gateway's session API (create, reward) with retries on transient failures.

    `api_key` is the environment key (the gateway's `--api-key`): it creates sessions and posts
    rewards, and is never given to an agent; each `Session` carries its own token instead."""

    url: str
    api_key: str = "local"
    retries: int = 5
    """Retries of a failed session-API call (unreachable, 502-504), `backoff_s` doubling: 5 ride
    out ~15 s, longer than a supervised gateway restart."""
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    limit_wait_s: float = 600.0
    """How long, in all, one call waits out 429 answers that carry `Retry-After` (the gateway's
    open-session, spool and backlog limits: back-pressure, not failures)."""
    _http: httpx.AsyncClient | None = field(default=None, repr=False)
    _openai_http: Any = field(default=None, repr=False)  # openai.DefaultAsyncHttpxClient

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.url.rstrip("/"),
                timeout=self.timeout_s,
                trust_env=False,
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
        return self._http

    def _openai_pool(self) -> Any:
        """One connection pool for every session's `openai.AsyncOpenAI` (each session has its own
        base URL, but building a client per session costs ~18 ms of CPU: its SSL context)."""
        if self._openai_http is None:
            self._openai_http = openai.DefaultAsyncHttpxClient(trust_env=False)
        return self._openai_http

    async def close(self) -> None:
        for pool in (self._http, self._openai_http):
            if pool is not None:
                await pool.aclose()
        self._http = self._openai_http = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", path, body)

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        last: GatewayError | None = None
        attempt, waited = 0, 0.0
        while True:
            try:
                r = await self._client().request(method, path, json=body, params=params)
            except httpx.HTTPError as exc:
                last = GatewayError(
                    f"gateway unreachable at {self.url}: {type(exc).__name__} {exc}".strip(), 0
                )
            else:
                if r.status_code == 200:
                    return r.json()
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text
                if r.status_code == 401:
                    message += " (pass the gateway's environment key: --api-key or PALAESTRA_API_KEY)"
                last = GatewayError(f"{method} {path}: {r.status_code} {message}", r.status_code)
                if r.status_code not in TRANSIENT:
                    raise last
                pause = _retry_after(r)
                if r.status_code == 429 and pause is not None and waited + pause <= self.limit_wait_s:
                    # Back-pressure (a gateway limit or a pause): wait as told, without using up
                    # the retries meant for failures; bounded by `limit_wait_s` in all.
                    waited += pause
                    await asyncio.sleep(pause)
                    continue
            if attempt >= self.retries:
                raise last
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    async def session(
        self,
        env: str,
        task_id: str = "",
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        max_retries: int = 6,
        sampling: Mapping[str, Any] | None = None,
    ) -> Session:
        """A new session on the gateway; `sampling` becomes its `Session.sampling`. Its client holds
        the session's token, so the agent can reach this session's routes and nothing else.

        `max_retries` is the agent client's (openai's backoff: 0.5 s doubling, capped at 8 s): 6
        rides out ~20 s of an unreachable gateway, longer than a supervised gateway restart
        (docs/reliability-faults.md), after which the session continues from its journal."""
        body = {"env": env, "task_id": task_id, "group_id": group_id, "metadata": metadata or {}}
        held = {k: v for k, v in (sampling or {}).items() if k in GATEWAY_SAMPLING}
        if held:  # the gateway applies them to every call of the session
            body["sampling"] = held
        info = await self._post("/sessions", body)
        if not info.get("api_key"):
            raise GatewayError(
                f"the gateway at {self.url} returned no session token ('api_key') from POST /sessions; "
                "it predates per-session tokens, and agents are never handed the environment key"
            )
        client = openai.AsyncOpenAI(
            base_url=info["base_url"],
            api_key=info["api_key"],
            max_retries=max_retries,
            timeout=self.timeout_s,
            http_client=self._openai_pool(),
        )
        return Session(
            info["session_id"],
            info["group_id"],
            info["base_url"],
            info["api_key"],
            client,
            self,
            sampling=dict(sampling or {}),
        )

    async def trajectory(self, session_id: str, text: bool = True) -> dict[str, Any]:
        """GET /sessions/{id}: the session's turns, forks and controls; with `text`, each turn's
        context and reply as text (gateway/sessions/as_text.py)."""
        return await self._call("GET", f"/sessions/{session_id}", params={"text": "true"} if text else None)

    async def reward(
        self,
        session_id: str,
        reward: float,
        metrics: dict[str, float] | None = None,
        status: str = "completed",
    ) -> dict[str, Any]:
        return await self._post(
            f"/sessions/{session_id}/reward",
            {"reward": float(reward), "metrics": metrics or {}, "status": status, "done": True},
        )


@dataclass
class Session:
    session_id: str
    group_id: str
    base_url: str
    api_key: str
    """The session's own token: opens only `base_url`'s routes (give it to an external agent)."""
    client: openai.AsyncOpenAI
    gateway: GatewayClient
    result: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for every `client.chat.completions.create` call of this episode, set by
    whoever runs it: `run_rollouts(sampling=..., seed=...)` (`temperature`; `seed`, this episode's
    own, so its samples are reproducible), which `palaestra train` sets to the trainer's
    temperature (the trainer's logprobs are only right at it) and `palaestra eval` to greedy.
    Pass them all: `create(..., **session.sampling)`; empty: the gateway's defaults. The gateway
    holds them too (sent at session creation): a call that omits one gets the session's value, and
    one that contradicts it is overruled and recorded (`ignored_controls`, a warning)."""

    @property
    def finished(self) -> bool:
        return self.result is not None

    async def reward(
        self, value: float, metrics: dict[str, float] | None = None, status: str = "completed"
    ) -> dict[str, Any]:
        """Finishes the session; returns once its samples are durable on the gateway."""
        self.result = await self.gateway.reward(self.session_id, value, metrics, status)
        return self.result

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        # `client` shares the GatewayClient's connection pool: closing it would close the pool for
        # every session, so the GatewayClient closes it once (`GatewayClient.close`).
        if not self.finished:
            status = "failed" if exc_type is not None else "aborted"
            await self.reward(0.0, failed_metrics(exc) if exc_type is not None else {}, status=status)
