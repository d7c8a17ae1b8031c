"""`GatewayMetrics`: the gateway's Prometheus metrics (`GET /metrics`), on a registry of its own.
Every labelled counter is created with each of its label values, so a scrape shows zeros, not
absences (the reasons come from the modules that refuse, fork or cut)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from palaestra.gateway.guards import CUT_REASONS, REJECT_REASONS
from palaestra.gateway.parsers import PARSE_ERROR_REASONS
from palaestra.gateway.sessions.trajectory import FORK_REASONS

__all__ = ["GatewayMetrics", "Children"]


class Children:
    """`metric.labels(*values)` for the per-call counters, each child looked up once: prometheus_client
    checks the values and takes a lock on every `labels()` call (7 per unstreamed call, ~5% of its
    profiled CPU). The child is the object `labels()` returns each time (nothing here removes one)."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric: Counter) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Counter] = {}

    def __call__(self, *values: str) -> Counter:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


def _by_reason(registry: CollectorRegistry, name: str, doc: str, reasons) -> Counter:
    """A counter labelled `reason`, created with every reason so that each scrapes as 0 from the start."""
    counter = Counter(name, doc, ["reason"], registry=registry)
    for reason in reasons:
        counter.labels(reason=reason)
    return counter


class GatewayMetrics:
    """Counters, gauges and the overhead histogram, all prefixed ``palaestra_gateway_``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "palaestra_gateway"
        self.calls = Counter(f"{p}_calls", "OpenAI calls answered", ["route", "status"], registry=r)
        self.turns = Counter(f"{p}_turns", "Turns recorded (one per sampled choice)", ["kind"], registry=r)
        self.forks = _by_reason(r, f"{p}_forks", "Turns that started a new sample, by reason", FORK_REASONS)
        self.call_child, self.turn_child, self.fork_child = map(
            Children, (self.calls, self.turns, self.forks)
        )
        self.bridged = Counter(
            f"{p}_bridged_turns", "Turns built on the previous turn's exact tokens", registry=r
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens sent to engines", registry=r)
        self.completion_tokens = Counter(f"{p}_completion_tokens", "Tokens sampled", registry=r)
        self.engine_errors = Counter(f"{p}_engine_errors", "Failed engine calls", ["code"], registry=r)
        self.parse_errors = _by_reason(
            r,
            f"{p}_parse_errors",
            "Outputs that did not parse (returned as content), by reason",
            PARSE_ERROR_REASONS,
        )
        self.sessions_created = Counter(f"{p}_sessions_created", "Sessions created", registry=r)
        self.sessions_finished = Counter(
            f"{p}_sessions_finished", "Sessions finished", ["status"], registry=r
        )
        self.samples = Counter(f"{p}_samples_spooled", "Samples made durable", registry=r)
        self.samples_dropped = Counter(
            f"{p}_samples_dropped",
            "Samples not spooled, by reason (routing: the routed experts do not cover the sample)",
            ["reason"],
            registry=r,
        )
        self.active = Gauge(f"{p}_active_sessions", "Sessions not yet rewarded", registry=r)
        self.in_flight = Gauge(f"{p}_in_flight_calls", "Generation calls in flight", registry=r)
        self.paused = Gauge(f"{p}_paused", "1 while generation is paused", registry=r)
        self.interrupted = Counter(
            f"{p}_interrupted_generations",
            "Engine calls a weight update interrupted, continued with the new weights (partial rollouts)",
            registry=r,
        )
        self.auth_refused = Counter(
            f"{p}_auth_refused",
            "Calls refused for their credential, by what the route needs (admin, environment, session) "
            "and status (401 missing/unknown, 403 out of scope)",
            ["scope", "status"],
            registry=r,
        )
        self.rejected = _by_reason(
            r, f"{p}_rejected_requests", "Requests refused before or while parsing, by reason", REJECT_REASONS
        )
        self.streams_cut = _by_reason(
            r, f"{p}_streams_cut", "Streamed answers ended before their last event, by reason", CUT_REASONS
        )
        self.ignored_controls = Counter(
            f"{p}_ignored_controls",
            "Calls that sent a control nothing here acts on (gateway/dialects/controls.py), by route and field",
            ["route", "control"],
            registry=r,
        )
        self.sampling_contradicted = Counter(
            f"{p}_sampling_contradicted",
            "Calls that set a sampling field to another value than their session's sampling (the "
            "session's was used; gateway/sessions/sampling.py), by route and field",
            ["route", "control"],
            registry=r,
        )
        self.max_tokens_clamped = Counter(
            f"{p}_max_tokens_clamped",
            "Calls whose max_tokens did not fit in the context and were clamped to it, by route",
            ["route"],
            registry=r,
        )
        self.overhead = Histogram(
            f"{p}_call_overhead_seconds",
            "Gateway time per call outside the engine",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
