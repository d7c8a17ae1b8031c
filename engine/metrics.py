"""Prometheus metrics of one embedded engine (its own registry, so several engines can share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # the *_created series only add noise to scrapes

PREFIX = "palaestra_engine"


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished generate requests, by finish type", ["finish"], registry=r
        )
        self.http_requests = Counter(
            f"{PREFIX}_http_generate_requests", "POST /generate calls received", registry=r
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens processed (incl. cache hits)", registry=r
        )
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens sampled", registry=r)
        self.prefix_query_tokens = Counter(
            f"{PREFIX}_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit_tokens = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            f"{PREFIX}_prefix_cache_hits", "Requests with a non-empty prefix-cache hit", registry=r
        )
        self.batch_size = Histogram(
            f"{PREFIX}_decode_batch_size",
            "Sequences per decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.decode_seconds = Histogram(
            f"{PREFIX}_decode_step_seconds", "Wall time of one decode step", registry=r
        )
        self.latency = Histogram(f"{PREFIX}_request_seconds", "Request latency, submit to finish", registry=r)
        self.running = Gauge(f"{PREFIX}_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge(f"{PREFIX}_waiting_requests", "Requests waiting for admission", registry=r)
        self.paused = Gauge(f"{PREFIX}_paused", "1 while generation is paused", registry=r)
        self.weight_version = Gauge(
            f"{PREFIX}_weight_version_info", "Current weight version (label)", ["version"], registry=r
        )
        self._version: str | None = None

    def record_prefix(self, query: int, hit: int) -> None:
        self.prefix_query_tokens.inc(query)
        if hit:
            self.prefix_hit_tokens.inc(hit)
            self.prefix_hits.inc()

    def observe_decode(self, batch: int, seconds: float) -> None:
        self.batch_size.observe(batch)
        self.decode_seconds.observe(seconds)

    def set_weight_version(self, version: str) -> None:
        if self._version is not None:
            self.weight_version.remove(self._version)
        self.weight_version.labels(version=version).set(1)
        self._version = version

    def watch_expert_load(self, load: Callable[[], list[list[int]]]) -> None:
        """Export an MoE model's per-expert load: `load()` gives, per layer, the tokens routed to
        each expert so far (engine/model_runner.py `Routing.load`); read at every scrape."""
        self.registry.register(_ExpertLoad(load))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ExpertLoad(Collector):
    """``palaestra_engine_moe_expert_tokens_total{layer, expert}``: tokens routed to each expert.
    Layers without experts (GLM's dense first layer) have no series."""

    def __init__(self, load: Callable[[], list[list[int]]]) -> None:
        self._load = load

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            f"{PREFIX}_moe_expert_tokens",
            "Tokens routed to each expert, by layer",
            labels=["layer", "expert"],
        )
        for layer, counts in enumerate(self._load()):
            if any(counts):
                for expert, count in enumerate(counts):
                    family.add_metric([str(layer), str(expert)], count)
        yield family
