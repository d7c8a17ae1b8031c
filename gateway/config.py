"""`GatewayConfig`: everything `palaestra gateway serve` takes, the run-tunable `GatewayOptions`
(`options.py`) and what a deployment sets (model, engine URL, address, keys, spool)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from palaestra.gateway.options import GatewayOptions

__all__ = ["GatewayConfig"]


@dataclass(kw_only=True)
class GatewayConfig(GatewayOptions):
    """Options of `palaestra gateway serve`: the run-tunable `GatewayOptions` and what a deployment
    sets (model, engine URL, address, keys, spool). The command's flags are generated from these
    fields (gateway/cli.py), each docstring being the flag's help."""

    model: str
    """Preset name or HF directory: its tokenizer and chat template."""

    engine_url: str
    """sglang-router URL (or one engine's) speaking SGLang /generate."""

    host: str = "127.0.0.1"
    """Bind address."""

    port: int = 8000
    """TCP port."""

    public_url: str | None = None
    """Base URL put into session base_urls (default: as requested)."""

    api_key: str | None = None
    """The environment key (or env PALAESTRA_API_KEY): the session API, /samples, /metrics and every
    session's /s/<id>/v1 routes. Agents get their session's own token instead (docs/gateway.md)."""

    admin_key: str | None = None
    """Admin key, for /admin routes only (or env PALAESTRA_ADMIN_KEY)."""

    insecure_local: bool = False
    """Serve without keys (loopback development only)."""

    spool_dir: str = "runs/spool"
    """Directory of the durable sample spool and of the session journal."""

    spool_segment_bytes: int = 64 << 20
    """Size at which the spool starts a new segment file (acknowledged segments are deleted whole)."""

    spool_keep_acked: bool = False
    """Keep spool segments whose samples are all acknowledged (POST /samples/ack); by default they
    are deleted, which is what bounds the spool's disk use."""

    journal_segment_bytes: int = 16 << 20
    """Size at which the session journal starts a new segment (segments of finished sessions are
    deleted whole)."""

    served_model_name: str | None = None
    """Model name in answers (default: --model)."""

    retry_after_s: int = 5
    """Retry-After seconds on 429."""

    engine_incremental_stream: bool = False
    """The engines run with --incremental-streaming-output (deltas instead of cumulative)."""

    engine_lora_adapter: str | None = None
    """A LoRA adapter the engines serve (SGLang's lora_path): named in every engine call, so the
    policy is that adapter on the base model (a LoRA run's trainer.lora.name). None = the base."""

    max_sessions: int = 10_000
    """Sessions kept in memory (finished ones are evicted oldest-first beyond this)."""

    start_paused: bool = False
    """Start paused, as after POST /admin/pause: generation calls wait until POST /admin/resume
    (`palaestra train` restarts a gateway that died during a weight sync this way)."""

    def resolve_keys(self) -> None:
        self.api_key = self.api_key or os.environ.get("PALAESTRA_API_KEY") or None
        self.admin_key = self.admin_key or os.environ.get("PALAESTRA_ADMIN_KEY") or None
        if not self.insecure_local and (not self.api_key or not self.admin_key):
            missing = [
                n
                for n, v in (
                    ("--api-key / PALAESTRA_API_KEY", self.api_key),
                    ("--admin-key / PALAESTRA_ADMIN_KEY", self.admin_key),
                )
                if not v
            ]
            raise SystemExit(
                f"palaestra gateway: no {' and no '.join(missing)} given. Every route but /health needs the "
                "environment key (or, for an agent, its session's token) and admin routes the admin key. Set "
                "them, or pass --insecure-local explicitly to serve without authentication on loopback."
            )
