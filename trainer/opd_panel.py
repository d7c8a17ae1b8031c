"""The teacher panel of on-policy distillation: named teachers, and which one(s) score each sample.

    trainer:
      opd:
        kl_coef: 0.5                          # default β of every teacher
        teachers:
          math:  {mode: megatron, model: /ckpt/math-teacher, granularity: topk, topk: 8}
          words: {mode: sglang, urls: ["http://10.0.0.7:30000"], opd_kl_coef: 0.2}
          big:   {mode: megatron, model: /ckpt/generalist, granularity: full}
        teacher_routing: env                  # or "my_pkg.routes:route" (an import path)
        teacher_mixtures:                     # optional: a weighted mixture for one domain
          code: {math: 0.3, big: 0.7}

Routing (`TeacherPanel.route`) gives each sample a `Route` — teacher names with weights summing
to 1 — by, in order: ``teacher_mixtures[sample.env]``; the teacher named like ``sample.env``;
a teacher whose ``envs`` list names it; the teacher called ``default``; the only teacher of a
one-teacher panel. A sample no rule covers is an error naming its env. With ``teacher_routing``
set to ``package.module:function``, that function decides instead:
``route(sample: Sample, teachers: Sequence[str]) -> str | Mapping[str, float]``.

A mixture's target distribution is the weighted *mixture of the teachers' distributions*,
q = Σ_i w_i q_i, i.e. log q(v) = logsumexp_i(log w_i + log q_i(v)) for each scored id
(`mix_logprobs`); its teachers must share a granularity, and its β is Σ_i w_i β_i.
`Route.label` is what `Sample.teacher` records: ``"math"``, or ``"0.3*math+0.7*big"``.

Scoring groups samples by teacher (`TeacherPanel.groups`), so that in one step each teacher's
weights are switched in once; `TeacherPanel.snapshot_order` is the order the snapshot store is
told (`SnapshotStore.plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from palaestra.plugins import load_object
from palaestra.sample import Sample

__all__ = ["Route", "TeacherPanel", "TeacherSpec", "mix_logprobs", "snapshot_tag"]

Granularity = Literal["sampled", "topk", "full"]
GRANULARITIES = ("sampled", "topk", "full")


def snapshot_tag(name: str) -> str:
    """The snapshot tag of a megatron-mode teacher."""
    return f"teacher/{name}"


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher of the panel (an entry of `TrainerConfig.opd.teachers`)."""

    name: str
    mode: Literal["megatron", "sglang"]
    model: str | None = None  # megatron: HF directory or preset, the student's architecture
    urls: tuple[str, ...] = ()  # sglang: engine or router URLs
    opd_kl_coef: float = 0.0  # β of this teacher
    granularity: Granularity = "sampled"
    topk: int = 8  # k of granularity topk
    concurrency: int = 8  # sglang: scoring requests in flight
    envs: tuple[str, ...] = ()  # environments routed here besides the one named like the teacher

    KEYS = ("mode", "model", "urls", "opd_kl_coef", "granularity", "topk", "concurrency", "envs")

    @classmethod
    def from_dict(cls, name: str, raw: Mapping[str, Any], default_coef: float) -> TeacherSpec:
        """Validates one `teachers` entry; errors name the field as ``teachers.<name>.<key>``."""
        where = f"teachers.{name}"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a mapping of teacher options, got {raw!r}")
        unknown = sorted(set(raw) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (known: {', '.join(cls.KEYS)})")
        mode = raw.get("mode")
        if mode not in ("megatron", "sglang"):
            raise ValueError(f"{where}.mode must be 'megatron' or 'sglang'; got {mode!r}")
        granularity = raw.get("granularity", "sampled")
        if granularity not in GRANULARITIES:
            raise ValueError(f"{where}.granularity must be one of {GRANULARITIES}; got {granularity!r}")
        if granularity == "full" and mode != "megatron":
            raise ValueError(
                f"{where}.granularity 'full' needs mode 'megatron' (an engine returns no full rows)"
            )
        if mode == "megatron" and not raw.get("model"):
            raise ValueError(f"{where}.model is required in megatron mode (a HF directory or preset)")
        urls = raw.get("urls") or []
        if mode == "sglang" and (not isinstance(urls, list) or not urls):
            raise ValueError(f"{where}.urls must list at least one engine URL in sglang mode")
        coef = float(raw.get("opd_kl_coef", default_coef))
        if coef < 0:
            raise ValueError(f"{where}.opd_kl_coef must be >= 0; got {coef}")
        topk = int(raw.get("topk", 8))
        if topk < 1:
            raise ValueError(f"{where}.topk must be >= 1; got {topk}")
        return cls(
            name=name,
            mode=mode,
            model=raw.get("model"),
            urls=tuple(str(u) for u in urls),
            opd_kl_coef=coef,
            granularity=granularity,
            topk=topk,
            concurrency=int(raw.get("concurrency", 8)),
            envs=tuple(raw.get("envs") or ()),
        )


@dataclass(frozen=True)
class Route:
    """Which teachers score a sample, with weights summing to 1 (one teacher: weight 1)."""

    weights: tuple[tuple[str, float], ...]

    @property
    def teachers(self) -> list[str]:
        return [name for name, _ in self.weights]

    @property
    def label(self) -> str:
        if len(self.weights) == 1:
            return self.weights[0][0]
        return "+".join(f"{w:g}*{name}" for name, w in self.weights)


RouteFn = Callable[[Sample, Sequence[str]], "str | Mapping[str, float]"]


def load_route_fn(path: str) -> RouteFn:
    if ":" not in path:
        raise ValueError(f"teacher_routing must be 'env' or 'package.module:function'; got {path!r}")
    return load_object(path, "teacher_routing", callable_=True)


@dataclass
class TeacherPanel:
    specs: dict[str, TeacherSpec]
    routing: str = "env"
    mixtures: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError("the teacher panel is empty")
        self._route_fn = None if self.routing == "env" else load_route_fn(self.routing)
        for env, weights in self.mixtures.items():
            self._route_from(weights, f"teacher_mixtures.{env}")

    @classmethod
    def from_config(
        cls,
        teachers: Mapping[str, Mapping[str, Any]],
        default_coef: float,
        routing: str = "env",
        mixtures: Mapping[str, Mapping[str, float]] | None = None,
    ) -> TeacherPanel:
        specs = {name: TeacherSpec.from_dict(name, raw, default_coef) for name, raw in teachers.items()}
        return cls(specs, routing, {k: dict(v) for k, v in (mixtures or {}).items()})

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def _route_from(self, answer: str | Mapping[str, float], where: str) -> Route:
        weights = {answer: 1.0} if isinstance(answer, str) else dict(answer)
        unknown = sorted(set(weights) - set(self.specs))
        if unknown:
            raise ValueError(f"{where}: unknown teachers {unknown} (panel: {self.names})")
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"{where}: weights must be >= 0 with a positive sum; got {weights}")
        grans = {self.specs[n].granularity for n in weights}
        if len(grans) > 1:
            raise ValueError(f"{where}: a mixture's teachers must share a granularity; got {sorted(grans)}")
        total = sum(weights.values())
        return Route(tuple((n, w / total) for n, w in weights.items() if w > 0))

    def route(self, sample: Sample) -> Route:
        """The teachers of one sample (module docstring: the rules, in order)."""
        if self._route_fn is not None:
            return self._route_from(self._route_fn(sample, self.names), f"teacher_routing {self.routing}")
        env = sample.env
        if env in self.mixtures:
            return self._route_from(self.mixtures[env], f"teacher_mixtures.{env}")
        if env in self.specs:
            return Route(((env, 1.0),))
        listed = [n for n, s in self.specs.items() if env in s.envs]
        if listed:
            return Route(((listed[0], 1.0),))
        if "default" in self.specs:
            return Route((("default", 1.0),))
        if len(self.specs) == 1:
            return Route(((self.names[0], 1.0),))
        raise ValueError(
            f"no teacher for env {env!r} (sample {sample.sample_id}): name a teacher after it, list it in "
            f"a teacher's envs, add a 'default' teacher or a teacher_mixtures entry (panel: {self.names})"
        )

    def groups(self, routes: Sequence[Route]) -> dict[str, list[int]]:
        """Teacher -> indices of the samples it scores, teachers in panel order (each switched in once)."""
        out: dict[str, list[int]] = {n: [] for n in self.specs}
        for i, r in enumerate(routes):
            for name in r.teachers:
                out[name].append(i)
        return {n: idx for n, idx in out.items() if idx}

    def snapshot_order(self, groups: Mapping[str, list[int]]) -> list[str]:
        """Snapshot tags of the megatron teachers this step uses, in scoring order."""
        return [snapshot_tag(n) for n in groups if self.specs[n].mode == "megatron"]

    def coef(self, route: Route) -> float:
        return sum(w * self.specs[n].opd_kl_coef for n, w in route.weights)

    def granularity(self, route: Route) -> Granularity:
        return self.specs[route.teachers[0]].granularity

    def topk(self, route: Route) -> int:
        return max(self.specs[n].topk for n in route.teachers)


def mix_logprobs(route: Route, scored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """log Σ_i w_i q_i at the same ids, from each teacher's logprobs (any shape, same for all)."""
    if len(route.weights) == 1:
        return scored[route.teachers[0]]
    parts = torch.stack([scored[n].float() + math.log(w) for n, w in route.weights])
    return torch.logsumexp(parts, dim=0)
