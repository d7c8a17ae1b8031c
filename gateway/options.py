"""`GatewayOptions`: the gateway options a training run may tune, declared once.

They are the tunable part of `palaestra.gateway.config.GatewayConfig` (which adds what a deployment
sets: model, engine URL, address, keys, spool), the ``gateway:`` section of a run config
(`palaestra.config.RunConfig.gateway`), and flags of ``palaestra gateway serve`` generated from the
fields below, their docstrings being the help. `serve_flags()` turns them back into those flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal

from palaestra.gateway.engine_side.engine_http import ENGINE_HTTP
from palaestra.gateway.engine_side.placement import PlacementConfig
from palaestra.gateway.event_loop import EVENT_LOOPS
from palaestra.typed_config import to_flags

# the flat placement keys of earlier configs -> their field in `placement`
_FLAT_PLACEMENT = {
    "placement_epsilon": "epsilon",
    "placement_move_epsilon": "move_epsilon",
    "placement_groups": "groups",
    "placement_pools": "pools",
    "placement_admit_fill": "admit_fill",
}

__all__ = ["GatewayOptions", "shard_file"]


def shard_file(path: str, index: int) -> str:
    """Shard `index`'s own file for `path`: `runs/r/routing.jsonl` -> `runs/r/routing.shard-1.jsonl`."""
    p = PurePath(path)
    return str(p.with_name(f"{p.stem}.shard-{index}{p.suffix}"))


@dataclass
class GatewayOptions:
    """The gateway's own options (those of `palaestra gateway serve` a run may tune)."""

    reasoning_policy: Literal["strip", "keep"] = "strip"
    """When the template drops earlier reasoning: strip = fork a new sample (template-faithful),
    keep = bridge anyway (continue on the exact tokens)."""

    pause_mode: Literal["wait", "reject"] = "wait"
    """While paused for a weight sync, new calls wait (up to pause_wait_s) or get 429 with
    Retry-After."""

    pause_wait_s: float = 600.0
    """Longest wait of a call while paused, seconds."""

    default_max_tokens: int = 4096
    """Max tokens of a call that sets none (capped by the context length)."""

    max_tokens_over_context: Literal["clamp", "reject"] = "clamp"
    """A call whose max_tokens does not fit in the context with its prompt: clamp = generate up to the
    room left (the turn records the clamp: field, asked, granted), reject = a 400
    context_length_exceeded naming the field (as OpenAI answers). Harnesses ask for more than a
    small model's context (Claude Code: 32000+)."""

    context_length: int | None = None
    """Context length in tokens; None = the engine's /server_info."""

    tool_parser: str = "auto"
    """Tool-call parser: auto (from the chat template), hermes, glm45, none, or module:attr."""

    reasoning_parser: str = "auto"
    """Reasoning parser: auto, qwen3, deepseek-r1, glm45, none."""

    engine_timeout_s: float = 600.0
    """Timeout of one engine call, seconds."""

    engine_retries: int = 2
    """Retries of an engine call that committed no tokens (connection refused, 5xx)."""

    engine_max_connections: int = 512
    """Connections to the engine (the router) the gateway keeps open at most; calls beyond them wait
    for a free one. In a run with gateway.shards=N each shard gets this divided by N (rounded up),
    so the fleet opens no more than one gateway would."""

    engine_http: Literal["auto", "bare", "aiohttp"] = "bare"
    """The HTTP client of engine calls: bare = a keep-alive HTTP/1.1 client of the gateway's own (an
    asyncio protocol and httptools' parser; the cheapest per call, plain http:// only); aiohttp =
    aiohttp's client (the fallback); auto = bare where it can serve the engine URL, else aiohttp."""

    journal_fsync: Literal["always", "batch", "off"] = "batch"
    """Session journal durability (docs/reliability-journal.md): always = fsync every record before
    the call answers (survives power loss); batch = fsync journal_fsync_interval_ms after a write (survives
    a killed process; a power loss drops at most that window); off = never fsync (a killed process)."""

    journal_fsync_interval_ms: float = 50.0
    """With journal_fsync=batch: the longest time a journal record waits for its fsync, ms."""

    max_open_sessions: int = 4096
    """Sessions not yet finished; POST /sessions beyond it gets 429 with Retry-After."""

    session_idle_timeout_s: float = 1800.0
    """A session with no call for this long is finished as aborted (metric failure/idle_timeout);
    0 = never."""

    spool_max_bytes: int = 50 << 30
    """Disk budget of the spool directory (samples + session journal), bytes; over it, POST /sessions
    gets 429 until the consumer acknowledges samples (POST /samples/ack) and they are deleted."""

    max_backlog_samples: int = 100_000
    """Durable samples not yet delivered to or acknowledged by a reader of /samples; over it, POST
    /sessions gets 429 (the trainer is behind)."""

    max_body_bytes: int = 32 << 20
    """Largest request body, bytes (default 32 MiB); a larger one gets 413 before it is parsed."""

    stream_send_timeout_s: float = 60.0
    """A streamed answer whose client reads nothing for this long (its socket buffers full) is
    ended and its engine request dropped, seconds."""

    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    """The event loop the gateway serves on: auto = uvloop where it is installed (cheaper socket
    reads, writes and loop passes per call and per streamed token), else asyncio's own; asyncio =
    always asyncio's; uvloop = uvloop or an error at start. The start logs the loop taken (info).
    The shards' front takes its own `palaestra gateway front --event-loop` (auto in a run)."""

    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """Workload-aware placement of sessions on engine workers (docs/routing.md): ``enabled``, its
    bounds and pools, each a field of `palaestra.gateway.engine_side.placement.PlacementConfig`."""

    return_routed_experts: bool = False
    """Ask every engine call for its routed experts (a mixture-of-experts policy's routing, for
    trainer.routing_replay r3): each turn asks them from the first position its sample does not yet
    have, and each sample carries them (`Sample.routed_experts`). The engines must run with
    --enable-return-routed-experts; `palaestra train` sets this when trainer.routing_replay is r3."""

    routing_trace: str | None = None
    """Append one JSON line per engine call (session, env, group, turn, prompt / cached / output
    tokens, engine seconds) to this file: the traffic bench/routing.py --trace replays. In a run with
    gateway.shards=N each shard writes its own file, <stem>.shard-<i><suffix>."""

    shards: int = 1
    """Gateway processes of a run (`palaestra train`): with N > 1, N gateways each own the sessions
    whose id hashes to them, each with its own spool and journal (<spool>/shard-<i>), behind one
    front (`palaestra gateway front`, gateway/shards.py). The limits above hold per shard. Not a
    flag of `palaestra gateway serve`: one serve is one shard."""

    def __post_init__(self) -> None:
        if not isinstance(self.placement, PlacementConfig):  # `placement: bool` before it was a section
            raise TypeError(
                f"placement must be a PlacementConfig (got {self.placement!r}); on/off is placement.enabled"
            )
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or not 1 <= self.shards <= 64:
            raise ValueError(f"gateway.shards must be an integer from 1 to 64 (got {self.shards!r})")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(
                f"gateway.event_loop must be one of {', '.join(EVENT_LOOPS)} (got {self.event_loop!r})"
            )
        if self.engine_http not in ENGINE_HTTP:
            raise ValueError(
                f"gateway.engine_http must be one of {', '.join(ENGINE_HTTP)} (got {self.engine_http!r})"
            )
        if (
            isinstance(self.engine_max_connections, bool)
            or not isinstance(self.engine_max_connections, int)
            or not 1 <= self.engine_max_connections <= 65536
        ):
            raise ValueError(
                "gateway.engine_max_connections must be an integer from 1 to 65536 "
                f"(got {self.engine_max_connections!r})"
            )

    def for_shard(self, index: int, shards: int) -> GatewayOptions:
        """These options for shard `index` of `shards` (a run's gateway.shards): the engine connections
        divided between the shards, and the routing record in a file of its own per shard
        (`shard_file`), since shards appending to one file would interleave their lines."""
        if shards <= 1:
            return self
        return dataclasses.replace(
            self,
            engine_max_connections=-(-self.engine_max_connections // shards),
            routing_trace=shard_file(self.routing_trace, index) if self.routing_trace else None,
        )

    def serve_flags(self) -> list[str]:
        """`palaestra gateway serve` arguments for these options (None = left to the gateway); the
        run adds model, URLs, keys and spool dir. Placement's are ``--placement-<field>``."""
        flat: dict[str, Any] = {}
        for f in dataclasses.fields(GatewayOptions):
            if f.name == "shards":  # the run's topology, not a gateway's option
                continue
            if f.name == "placement":
                for p in dataclasses.fields(PlacementConfig):
                    flat[f"placement_{p.name}"] = getattr(self.placement, p.name)
            else:
                flat[f.name] = getattr(self, f.name)
        return to_flags(flat)

    @staticmethod
    def moved_key(key: str, value: Any) -> tuple[str, Any] | None:
        """Where a key of an earlier ``gateway:`` section now lives (`typed_config` reads it there and
        says so): ``placement: true`` is ``placement.enabled``, ``placement_<x>`` is ``placement.<x>``."""
        if key == "placement" and isinstance(value, bool):
            return "placement.enabled", value
        if key in _FLAT_PLACEMENT:
            return f"placement.{_FLAT_PLACEMENT[key]}", value
        return None
