"""The orchestration of on-policy distillation in a step: route samples to teachers, score them, fill
the micro-batches.

`Distiller` owns the teacher panel of a `Trainer` (opd_panel.py): megatron-mode teachers live
in the snapshot store as ``teacher/<name>``, engine teachers are `SGLangTeacher` clients
(opd_teachers.py). Per step:

1. `route(samples)` picks each sample's teacher(s) and records the route in `Sample.teacher`;
2. `score(samples, mbs, routes, topk_ids)` scores, teacher by teacher, the samples routed to it —
   a megatron teacher in one forward pass over micro-batches of just its samples (its weights
   switched in once), an engine teacher over HTTP — then mixes the answers of mixture routes and
   fills the OPD fields of the step's micro-batches (`MicroBatch`, packing.py, documents each):

   ``teacher_logprobs``               teacher logprob of every sampled token (all routes; metrics)
   ``opd_coef_sampled``               β on rows of `sampled` routes (advantage term), else 0
   ``opd_coef_topk``, ``opd_topk_ids``, ``opd_topk_teacher``, ``opd_topk_valid``
   ``opd_coef_full``, ``opd_full_teacher``                 (rows × vocab shard, CPU)
   ``opd_route``                      index of the row's route in `labels` (per-route metrics)

objective.py turns the topk and full fields into loss terms (opd_kl.py has the formulas).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from palaestra.sample import Sample
from palaestra.trainer import losses, opd_kl
from palaestra.trainer.opd_panel import Route, TeacherPanel, mix_logprobs, snapshot_tag
from palaestra.trainer.packing import MicroBatch, build_micro_batch, first_fit_decreasing

if TYPE_CHECKING:
    from palaestra.trainer.trainer import Trainer

__all__ = ["Distiller"]

Scores = dict[str, torch.Tensor]  # kind ("sampled", "topk", "full") -> per-row tensor of one sample


class Distiller:
    def __init__(self, trainer: Trainer, panel: TeacherPanel):
        from palaestra.trainer.opd_teachers import (
            SGLangTeacher,
            TeacherError,
            load_teacher_tensors,
            tokenizer_fingerprint,
        )

        self.trainer = trainer
        self.panel = panel
        self.engines: dict[str, SGLangTeacher] = {}
        student_fp: str | None = None
        for name, spec in panel.specs.items():
            if spec.mode == "megatron":
                # same architecture is checked by load_teacher_tensors; same tokenizer here, when the
                # teacher's directory carries one (OPD compares token ids)
                if any(
                    (Path(str(spec.model)) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
                ):
                    student_fp = student_fp or tokenizer_fingerprint(trainer.model_dir)
                    if tokenizer_fingerprint(str(spec.model)) != student_fp:
                        raise TeacherError(
                            f"teacher {name!r} ({spec.model}) has another tokenizer than the student "
                            f"({trainer.model_dir}); OPD needs one tokenizer on both sides"
                        )
                tensors = load_teacher_tensors(str(spec.model), trainer.arch)  # a directory (checked)
                trainer.snapshots.load(snapshot_tag(name), trainer.shard_model(tensors))
            else:
                self.engines[name] = SGLangTeacher(spec.urls, trainer.model_dir, spec.concurrency)
        self.labels: list[str] = []  # route labels seen so far (metrics index)

    # -- routing --------------------------------------------------------------------------------
    def route(self, samples: Sequence[Sample]) -> list[Route]:
        routes = [self.panel.route(s) for s in samples]
        for s, r in zip(samples, routes, strict=True):
            s.teacher = r.label
            # every rank routes the same (broadcast) samples, so labels get the same indices on
            # all DP ranks and the per-route sums can be all-reduced
            if r.label not in self.labels:
                self.labels.append(r.label)
        return routes

    def topk_needed(self, routes: Sequence[Route]) -> int:
        """The largest k among this step's topk routes (0: none) — how many ids the student pass keeps."""
        ks = [self.panel.topk(r) for r in routes if self.panel.granularity(r) == "topk"]
        return max(ks, default=0)

    def snapshot_order(self, routes: Sequence[Route]) -> list[str]:
        return self.panel.snapshot_order(self.panel.groups(routes))

    # -- scoring --------------------------------------------------------------------------------
    def _megatron(
        self, name: str, samples: Sequence[Sample], idx: list[int], topk_ids: dict[int, torch.Tensor]
    ):
        t, spec = self.trainer, self.panel.specs[name]
        group = t.tp()[0]
        bins = first_fit_decreasing([len(samples[i].tokens) for i in idx], t.config.max_tokens_per_microbatch)
        mbs = [build_micro_batch(samples, [idx[j] for j in b]) for b in bins]
        want_topk = spec.granularity == "topk" and all(i in topk_ids for i in idx)
        if want_topk:
            for mb in mbs:
                mb.opd_topk_ids = torch.cat([topk_ids[i] for i in mb.sample_indices])

        def rows_fn(mb: MicroBatch, rows: torch.Tensor) -> dict[str, torch.Tensor]:
            out = {"sampled": losses.vocab_parallel_logprobs(rows, mb.targets.to(rows.device), 1.0)}
            if want_topk:
                out["topk"] = opd_kl.gather_logprobs(rows, mb.opd_topk_ids.to(rows.device), 1.0, group)
            elif spec.granularity == "full":
                out["full"] = opd_kl.full_logprobs(rows, 1.0, group)
            return {k: v.detach().float().cpu() for k, v in out.items()}

        scored: dict[int, Scores] = {}
        for mb, out in zip(mbs, t.forward_rows(mbs, snapshot_tag(name), rows_fn), strict=True):
            split = {k: mb.per_sample(v) for k, v in out.items()}
            for j, i in enumerate(mb.sample_indices):
                scored[i] = {k: v[j] for k, v in split.items()}
        return scored

    def _engine(
        self, name: str, samples: Sequence[Sample], idx: list[int], topk_ids: dict[int, torch.Tensor]
    ):
        from megatron.core import parallel_state

        spec = self.panel.specs[name]
        group, rank, size = self.trainer.tp()
        box: list[Any] = [None]
        if rank == 0:  # TP ranks share their micro-batches: score once, share the answer
            want_topk = spec.granularity == "topk" and all(i in topk_ids for i in idx)
            ids = [topk_ids[i] for i in idx] if want_topk else None
            box[0] = self.engines[name].score_with_ids([samples[i] for i in idx], ids)
        if size > 1:
            dist.broadcast_object_list(
                box, src=parallel_state.get_tensor_model_parallel_src_rank(), group=group
            )
        scored: dict[int, Scores] = {}
        for i, (lps, top) in zip(idx, box[0], strict=True):
            scored[i] = {"sampled": torch.tensor(lps, dtype=torch.float32)}
            if top is not None:
                scored[i]["topk"] = torch.tensor(top, dtype=torch.float32)
        return scored

    def score(
        self,
        samples: Sequence[Sample],
        mbs: Sequence[MicroBatch],
        routes: Sequence[Route],
        topk_ids: dict[int, torch.Tensor],
    ) -> dict[str, float]:
        """Scores this rank's samples and fills the OPD fields of `mbs` (module docstring); returns metrics."""
        mine = [i for mb in mbs for i in mb.sample_indices]
        # each topk route scores the student's top panel.topk(route) ids (a mixture: its largest k)
        topk_ids = {i: topk_ids[i][:, : self.panel.topk(routes[i])] for i in mine if i in topk_ids}
        # a sampled-granularity sample that arrived with teacher logprobs is not rescored
        given = {
            i for i in mine if self.panel.granularity(routes[i]) == "sampled" and samples[i].teacher_logprobs
        }
        groups: dict[str, list[int]] = {}
        for i in mine:
            if i not in given:
                for n in routes[i].teachers:
                    groups.setdefault(n, []).append(i)
        scored: dict[str, dict[int, Scores]] = {}
        metrics: dict[str, float] = {}
        for name in self.panel.names:  # panel order = the order given to SnapshotStore.plan
            if name not in groups:
                continue
            started = time.perf_counter()
            how = self._engine if name in self.engines else self._megatron
            scored[name] = how(name, samples, groups[name], topk_ids)
            metrics[f"opd/{name}/score_s"] = time.perf_counter() - started
        n = max(1, len(mine))
        for name in self.panel.names:
            share = sum(w for i in mine for t, w in routes[i].weights if t == name)
            metrics[f"opd/{name}/share"] = share / n
        targets = {}
        for i in mine:
            r = routes[i]
            if i in given:
                targets[i] = {"sampled": torch.tensor(samples[i].teacher_logprobs, dtype=torch.float32)}
                continue
            kinds = scored[r.teachers[0]][i].keys()
            targets[i] = {k: mix_logprobs(r, {t: scored[t][i][k] for t in r.teachers}) for k in kinds}
            if "topk" in targets[i]:
                targets[i]["topk_ids"] = topk_ids[i]
        for mb in mbs:
            self._fill(mb, samples, routes, targets)
        return metrics

    def route_metrics(self, mbs: Sequence[MicroBatch]) -> dict[str, float]:
        """opd/<route>/reverse_kl over the step's policy-sampled tokens (all DP ranks), from the
        per-row estimates the training pass left in `MicroBatch.opd_rkl` (objective.py)."""
        from megatron.core import parallel_state

        n = len(self.labels)
        sums = torch.zeros(2, max(n, 1))
        for mb in mbs:
            if mb.dummy or mb.opd_rkl is None:
                continue
            sums[0].index_add_(0, mb.opd_route, mb.opd_rkl * mb.loss_mask)
            sums[1].index_add_(0, mb.opd_route, mb.loss_mask)
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        return {
            f"opd/{label}/reverse_kl": float(sums[0, j] / sums[1, j])
            for j, label in enumerate(self.labels)
            if sums[1, j] > 0
        }

    def viewer_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per sample, its route's logprob of each response token (the trajectory viewer's handful)."""
        mbs = [build_micro_batch(samples, list(range(len(samples))))]
        self.score(samples, mbs, self.route(samples), topk_ids={})  # the sampled tokens only
        return [r.tolist() for r in mbs[0].per_sample(mbs[0].teacher_logprobs)]

    def _fill(self, mb: MicroBatch, samples, routes: Sequence[Route], targets: dict[int, Scores]) -> None:
        r_rows = mb.num_rows
        sizes = [b - a for a, b in zip(mb.response_offsets[:-1], mb.response_offsets[1:], strict=True)]
        zeros = torch.zeros(r_rows)
        if mb.dummy:
            mb.teacher_logprobs = zeros
            return
        per = [targets[i] for i in mb.sample_indices]
        mb.teacher_logprobs = torch.cat([t["sampled"] for t in per])
        coef = {g: [] for g in ("sampled", "topk", "full")}
        route_index = []
        for i, size in zip(mb.sample_indices, sizes, strict=True):
            r = routes[i]
            g = self.panel.granularity(r)
            for kind in coef:
                coef[kind].append(torch.full((size,), self.panel.coef(r) if kind == g else 0.0))
            if r.label not in self.labels:  # a route not made by route() (a caller's own)
                self.labels.append(r.label)
            route_index.append(torch.full((size,), self.labels.index(r.label), dtype=torch.long))
        mb.opd_coef_sampled, mb.opd_coef_topk, mb.opd_coef_full = (torch.cat(coef[k]) for k in coef)
        mb.opd_route = torch.cat(route_index)
        if any("topk" in t for t in per):
            k = max(t["topk"].shape[-1] for t in per if "topk" in t)
            ids = torch.zeros(r_rows, k, dtype=torch.long)
            lp = torch.zeros(r_rows, k)
            valid = torch.zeros(r_rows, k, dtype=torch.bool)
            for j, t in enumerate(per):
                if "topk" in t:
                    a, kk = mb.response_offsets[j], t["topk"].shape[-1]
                    rows = slice(a, a + t["topk"].shape[0])
                    ids[rows, :kk], lp[rows, :kk], valid[rows, :kk] = t["topk_ids"], t["topk"], True
            mb.opd_topk_ids, mb.opd_topk_teacher, mb.opd_topk_valid = ids, lp, valid
        if any("full" in t for t in per):
            width = next(t["full"].shape[-1] for t in per if "full" in t)
            full = torch.zeros(r_rows, width)
            for j, t in enumerate(per):
                if "full" in t:
                    a = mb.response_offsets[j]
                    full[a : a + t["full"].shape[0]] = t["full"]
            mb.opd_full_teacher = full
        mb.check()
