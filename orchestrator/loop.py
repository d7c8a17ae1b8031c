"""One run on a started cluster: its steps, evaluations, checkpoints and report (`Run`), and what it
returns (`RunResult`). `palaestra.train.train` calls these in order; read it first.

    with start_cluster(cfg, ...) as cluster, Run(cfg, cluster, state, fresh=True) as run:
        run.evaluate_before()
        with run.stepping():
            batch = run.next_batch(step); metrics = run.train(step, batch)
            metrics |= run.sync(step, batch); metrics |= run.end_step(step, batch)
            run.log(step, metrics); run.checkpoint()
        run.evaluate_after(); return run.report(run.result())

The weight version is the trainer's: `sync` stores what the trainer reports after pushing its
weights, and nothing here counts versions.

Every wait, and every HTTP call of the driver's to a server (the gateway's cursor, its
acknowledgement and admin, the engines' versions: `Waiter.call`), goes through the run's
`Supervisor` (supervisor.py): dead servers are restarted in place and the wait or call goes on; a
dead environment runner or trainer raises `Replaced` out of the step, and `train` calls
`run.recover(fault)`, which redoes the run from its state (for the trainer: from the last
checkpoint). `RunResult.faults` lists every fault of the launch, `faults.json` every fault of the
run (written as they happen, an earlier launch's kept, each marked by its launch). `trained.jsonl` (the step
ledger, `ledger.note_step`) keeps what every step of every launch trained, for a driver killed
and resumed.

`Run(..., hook=fn)` calls `fn(phase, step, run)` in the driver's thread at each of `PHASES`, so a
test can kill a process at a defined moment of a step, however fast the step runs.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from palaestra.config import RunConfig, config_to_dict
from palaestra.orchestrator.batching import Batch, SampleFeed
from palaestra.orchestrator.checkpoint import RunState, checkpoint_dir, commit_checkpoint
from palaestra.orchestrator.cluster import Cluster
from palaestra.orchestrator.errors import Replaced, RunFailed
from palaestra.orchestrator.ledger import note_step
from palaestra.orchestrator.metrics import console_line, make_tracker, rollout_metrics
from palaestra.orchestrator.modes import SOURCES
from palaestra.orchestrator.supervisor import RUNNER, TRAINER, Supervisor, earlier_faults, write_faults
from palaestra.orchestrator.waiting import Waiter
from palaestra.sample import Sample

__all__ = ["EVAL_SEED", "PHASES", "Hook", "Run", "RunResult", "StepRecord", "earlier_launch"]

log = logging.getLogger(__name__)

# Held-out tasks come from this seed of `env.tasks(seed)` — the same set for every run, whatever
# its training seed (a finite task list that ignores the seed is not held out: see docs/training.md).
EVAL_SEED = 1_000_003
VIEWER_PER_STEP = 8
"""Samples of each earlier step the trajectory viewer shows (all of the last step's, up to 64)."""

PHASES = ("batch", "sync", "checkpoint", "checkpoint_saved", "step")
"""Where `Run.at` calls the run's hook, with the step (0-based) the phase belongs to:

* ``batch``: the step's batch is read (generation done, in sync mode), nothing of it trained yet;
* ``sync``: the step is trained, its weight sync is about to start (async: the gateway drained);
* ``checkpoint``: a checkpoint is due after the step, the trainer has not saved yet;
* ``checkpoint_saved``: the checkpoint is whole (`latest` moved), the gateway's spool not yet told;
* ``step``: the step is over (logged, checkpointed if due)."""

Hook = Callable[[str, int, "Run"], None]
"""`hook(phase, step, run)`: called in the driver's thread at each of `PHASES`; the run waits for it."""


@dataclass
class StepRecord:
    """What one step trained (the tests check the staleness bound and the data order with it)."""

    step: int
    trainer_version: int  # before the update
    task_indices: list[int]
    task_ids: list[str]
    sample_ids: list[str]
    lags: list[float]  # per trained sample, weight versions behind the trainer
    versions: list[list[str]]  # per trained sample, the weight versions that sampled its tokens
    masked: int  # samples trained with loss_mask zeroed (stale_policy mask)


@dataclass
class RunResult:
    output_dir: Path
    start_step: int
    start_weight_version: int
    start_cursors: list[int]  # per gateway shard
    state: RunState
    engine_versions_start: list[str]
    engine_versions_end: list[str]
    trained: list[StepRecord]
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    startup_s: dict[str, float]
    summary: str = ""
    reward_curve: Path | None = None
    viewer: Path | None = None
    teacher_accuracy: float | None = None  # env.eval_teacher: the teacher on the same tasks
    faults: list[dict] | None = None  # every process death: component, time, action, recovery_s
    not_trained: dict[str, str] | None = None  # sample_id -> why, of this launch's samples not trained


def earlier_launch(state: RunState) -> dict[str, str]:
    """What a launch resumed from `state` records as not trained at once: the killed launch's
    samples read before the checkpoint's cursors that no step had taken (`RunState.unclaimed`),
    which it never reads again (those read after them are `SampleFeed`'s `earlier_launch`)."""
    return dict.fromkeys(state.unclaimed, "earlier_launch")


class Run:
    """The driver's side of one run: it waits on the boxes, never computes what they compute."""

    def __init__(
        self, cfg: RunConfig, cluster: Cluster, state: RunState, *, fresh: bool, hook: Hook | None = None
    ):
        self.cfg, self.cluster, self.state, self.hook = cfg, cluster, state, hook
        self.out = cfg.output_dir
        self.start = (state.step, state.weight_version, list(state.cursors))
        self.tracker = make_tracker(
            cfg.logging, self.out, run_name=cfg.run.name, config=config_to_dict(cfg), fresh=fresh
        )
        assert cluster.gateway is not None and cluster.gateway.url is not None
        try:
            self.feed = SampleFeed(
                cluster.gateway.url, cluster.api_key, cluster.run_id, state.cursors, cfg.gateway.shards
            )
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        self.supervisor = Supervisor(cluster, cfg.run.max_restarts, launch=cluster.run_id)
        # faults.json keeps the earlier launches' faults (a resumed run), each marked by its launch
        self.earlier_faults = [] if fresh else earlier_faults(self.out / "faults.json")
        self.waiter = Waiter(self.supervisor, cfg.run.step_timeout_s)
        self.initial = copy.deepcopy(state)  # what a trainer death rolls back to without a checkpoint
        self.source = self._new_source()
        if fresh and cfg.trainer.lora.enabled:  # the gateway names the adapter in every call
            self.waiter.get(cluster.trainer_call("sync_weights"), "serving the start adapter (B = 0)")
            self._note_engine_weights()
        self.engine_versions_start = self._engine_versions()
        self.trained: list[StepRecord] = []
        self.last_samples: list[Sample] = []
        self.last_step = 0  # the step (1-based) last_samples trained
        self.earlier_samples: list[dict] = []  # a few per step, for the viewer's step-by-step view
        self.counts: Counter[str] = Counter(state.counts)
        self.eval_before: dict[str, float] | None = None
        self.eval_after: dict[str, float] | None = None
        self._bar = None
        self._times: dict[str, float] = {}  # this step's clock readings (perf/*)
        self.not_trained: dict[str, str] = {}  # the batches' dropped samples, and undone steps' ones
        self.ledger = self.out / "trained.jsonl"  # every launch's steps (`ledger.note_step`)
        if not fresh:
            self.not_trained.update(earlier_launch(state))
        self._noted: set[str] = set()  # samples the step ledger already records as not trained
        self._stepping = False
        self.deferred: Replaced | None = None  # a fault seen mid-sync, redone at the next step
        # The last step's row, held for the evaluation after it: metrics.jsonl gets one row per step.
        self._held_row: tuple[dict[str, float], int] | None = None

    def _new_source(self):
        """The mode's source from the run's state (a new attempt after each fault)."""
        state = self.state
        return SOURCES[self.cfg.run.mode](
            self.cfg,
            self.cluster,
            self.feed,
            self.waiter,
            first=state.watermark,
            skip=state.consumed_above,
            attempt=self.feed.attempt,
        )

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.feed.close()
        self._log_held({})  # the last step's row, when its evaluation never came
        self.tracker.close()

    def at(self, phase: str, step: int) -> None:
        """The run's hook at `phase` (one of `PHASES`) of `step`, if it has one."""
        assert phase in PHASES, phase
        if self.hook is not None:
            self.hook(phase, step, self)

    # -- before the first step -----------------------------------------------------------------
    def restore(self, ckpt: Path) -> None:
        """The checkpoint's trainer (weights, optimizer, RNG), then its weights onto the engines."""
        self.waiter.begin(f"resuming from {ckpt.name}")
        loaded = self.waiter.get(
            self.cluster.trainer_call("load", str(ckpt / "trainer")), "loading the checkpoint"
        )[0]
        if loaded["weight_version"] != self.state.weight_version:
            raise RunFailed(
                f"{ckpt}: the trainer checkpoint is at weight version {loaded['weight_version']}, "
                f"the run state at {self.state.weight_version}"
            )
        self.waiter.get(self.cluster.trainer_call("sync_weights"), "syncing the checkpoint's weights")
        self._note_engine_weights()

    def _note_engine_weights(self) -> None:
        """Where the weights the engines now hold lie, for an engine restarted later."""
        ref = self.cluster.trainer[0].synced_weights_dir.remote()
        directory = self.waiter.get([ref], "reading where the synced weights lie")[0]
        self.cluster.engine_weights = (str(self.state.weight_version), directory)

    def evaluate_before(self) -> None:
        """Held-out accuracy before training: the reward curve's first point (step 0)."""
        self.eval_before = self.evaluate("before")
        row = {"train/step": 0.0, **eval_row(self.eval_before)}
        self.state.rows.append(row)
        self.tracker.log(row, 0)  # metrics.jsonl's step-0 row

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """The mode's generation (begun before the first step) and the progress bar, for the steps;
        both end however the steps end."""
        self._bar = _progress(self.cfg.run.steps, self.state.step)
        if self.state.step < self.cfg.run.steps:
            self.source.begin(self.state.step)
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self.source.end()

    # -- one step ------------------------------------------------------------------------------
    def next_batch(self, step: int) -> Batch:
        """This step's groups, as `run.mode` produces them, through the staleness bound and filters."""
        if self.deferred is not None:
            fault, self.deferred = self.deferred, None
            raise fault
        self._times = {"start": time.perf_counter()}
        self.waiter.start_step(step)
        # a box that died between steps (an engine's node) is repaired before the step generates
        self.supervisor.check_alive("the step's start")
        self.supervisor.rejoin_engines("the step's start")  # an engine left out, where a node joined
        self._times["gateway_s"] = self.cluster.gateway_overhead_s()
        batch = self.source.batch(step, self.state.weight_version)
        self._times["batch"] = time.perf_counter()
        self.at("batch", step)
        return batch

    def train(self, step: int, batch: Batch) -> dict[str, float]:
        """The batch's rollout metrics and one optimizer step on it; the engines keep the old
        weights. A batch the filters emptied trains nothing (the step still counts)."""
        metrics = rollout_metrics(batch)
        self._count(batch)
        self.not_trained.update(batch.dropped)
        if batch.samples:
            ref = self.cluster.trainer_call("train", [], rank0_args=(batch.samples,))
            try:
                metrics.update(self.waiter.get(ref, "training")[0])
            except Replaced:  # the trainer died with the batch: it is generated again
                self.not_trained.update(
                    dict.fromkeys((s.sample_id for s in batch.samples), "trainer_restart")
                )
                raise
            self.trained.append(
                StepRecord(
                    step=step,
                    trainer_version=self.state.weight_version,
                    task_indices=[g.task_index for g in batch.groups],
                    task_ids=[g.task_id for g in batch.groups],
                    sample_ids=[s.sample_id for s in batch.samples],
                    lags=batch.lags,
                    versions=[sorted({v for v in s.weight_versions if v}) for s in batch.samples],
                    masked=batch.counts["stale_masked"],
                )
            )
            if self.last_samples:  # the previous step's, now history: keep a few
                self.earlier_samples += [
                    {**s.to_dict(), "step": self.last_step} for s in self.last_samples[:VIEWER_PER_STEP]
                ]
            self.last_samples, self.last_step = batch.samples, step + 1
        else:
            log.warning("step %d: no sample left to train after filtering (%s)", step + 1, batch.why_empty())
        self._times["train_s"] = time.perf_counter() - self._times["batch"] if batch.samples else 0.0
        metrics["perf/train_s"] = self._times["train_s"]
        return metrics

    def sync(self, step: int, batch: Batch) -> dict[str, float]:
        """What the mode does first (one-step-off: the next batch's generation ends; async: the
        gateway drains), then the new weights onto every engine; the version is the trainer's."""
        if not batch.samples:  # nothing trained: nothing to send
            self._deferring(self.source.after_sync, step)
            self._times["sync_s"] = 0.0
            return {"perf/drain_s": 0.0, "perf/sync_s": 0.0}
        drain_s = self._deferring(self.source.before_sync, step) or 0.0
        self.at("sync", step)
        started = time.perf_counter()
        call = lambda: self.cluster.trainer_call("sync_weights")  # noqa: E731 (tried again after a restart)
        version, metrics = self.waiter.get(call(), "weight sync", again=call)[0]
        self._deferring(self.source.after_sync, step)
        self.state.weight_version = version
        self._note_engine_weights()
        self._times["sync_s"] = time.perf_counter() - started
        return {**metrics, "perf/drain_s": drain_s, "perf/sync_s": self._times["sync_s"]}

    def _deferring(self, fn, step: int):
        """`fn(step)`; a runner or gateway fault it raises is kept for the next step to redo (this
        step is trained: raising now would train it twice). A trainer fault goes on up."""
        try:
            return fn(step)
        except Replaced as fault:
            if fault.component == TRAINER:
                raise
            self.deferred = fault
            return None

    def end_step(self, step: int, batch: Batch) -> dict[str, float]:
        """The tasks the step consumed, the spool cursor, and the step's timing (`perf/*`)."""
        self.state.consume([g.task_index for g in batch.considered])
        self.state.cursors = list(self.feed.cursors)
        self.state.unclaimed = sorted({*self.feed.buffer, *self.source.unused()})  # read, not trained yet
        trained = self.trained[-1].sample_ids if self.trained and self.trained[-1].step == step else []
        self._note_step(step + 1, trained, {**self.feed.dropped, **self.not_trained})
        t = self._times
        wall = time.perf_counter() - t["start"]
        return {
            "train/step": float(step + 1),
            "train/weight_version": float(self.state.weight_version),
            "perf/step_wall_s": wall,
            "perf/wait_s": t["batch"] - t["start"],
            "perf/wait_time_ratio": (t["batch"] - t["start"]) / wall,  # slime's: the trainer waiting
            "perf/trainer_idle_s": max(0.0, wall - t["train_s"] - t["sync_s"]),
            # a gateway restarted during the step starts its histogram at 0: no negative figure
            "perf/gateway_s": max(0.0, self.cluster.gateway_overhead_s() - t["gateway_s"]),
            "perf/samples_per_s": len(batch.samples) / wall,
        }

    def _count(self, batch: Batch) -> None:
        """Run totals (checkpointed): the batch's decisions, sessions per status, the feed's skips."""
        self.counts.update(batch.counts)
        self.counts.update({f"sessions_{k}": v for k, v in batch.session_statuses().items()})
        self.counts.update({f"feed_{k}": v for k, v in self.feed.counts.items()})
        self.feed.counts.clear()
        self.state.counts = dict(self.counts)

    def evaluation_due(self, step: int) -> bool:
        """Evaluate after this step? Every `env.eval_every` steps, not after the last (the final
        evaluation follows it anyway)."""
        done, every = step + 1, self.cfg.env.eval_every
        return bool(every) and done % every == 0 and done < self.cfg.run.steps

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The step's row: into the run state, every tracker, the console line and the progress bar."""
        state, steps, done = self.state, self.cfg.run.steps, step + 1
        state.step, state.rows = done, [*state.rows, metrics]
        counters = self.supervisor.new_counters()
        if counters:  # on disk as they happen: a driver killed later leaves them for the resumed launch
            self._write_faults()
        metrics = {**metrics, **counters}
        self._log_held({})  # a held last step that a fault's recovery made the run redo: its row too
        if done == steps and self.cfg.env.eval_tasks:
            self._held_row = (metrics, done)  # logged with the evaluation after it (`evaluate_after`)
        else:
            self.tracker.log(metrics, done)
        if done % self.cfg.logging.console_every == 0 or done == steps:
            _print(console_line(done, steps, metrics), self._bar)
        if self._bar is not None:
            reward = metrics.get("rollout/reward_mean", math.nan)
            self._bar.set_postfix(reward=f"{reward:.3f}", refresh=False)
            self._bar.update(1)

    def _write_faults(self) -> None:
        """faults.json: the earlier launches' faults, then this launch's."""
        write_faults(
            self.out / "faults.json", [*self.earlier_faults, *(f.to_dict() for f in self.supervisor.faults)]
        )

    def _note_step(self, step: int | None, trained: list[str], not_trained: dict[str, str]) -> None:
        """The step ledger's line (`ledger.note_step`): written before the step's checkpoint, so a
        driver killed at any moment leaves every step it checkpointed on record."""
        new = {sid: why for sid, why in not_trained.items() if sid not in self._noted}
        self._noted.update(new)
        note_step(self.ledger, self.cluster.run_id, step, trained, new)

    # -- after a fault -------------------------------------------------------------------------
    def recover(self, fault: Replaced) -> None:
        """Redoes the run from its state after `fault`: the generation in flight is abandoned (its
        groups' samples are recorded as not trained, with the fault as the reason) and begun again
        by a new source; a dead trainer is rebuilt from the last checkpoint first. A death during
        the recovery is recovered from in turn (each counts against `run.max_restarts`)."""
        while True:
            try:
                return self._recover(fault)
            except Replaced as again:
                fault = again

    def _recover(self, fault: Replaced) -> None:
        record = self.supervisor.last(fault.component)
        self.waiter.begin(f"recovering from the {fault.component}'s death")
        with suppress(Exception):  # the old source's generation may be on the dead runner
            self.source.end()
        if fault.component == TRAINER:
            action = self._restore_trainer()
        else:
            action = record.action
        reason = {RUNNER: "runner_died", TRAINER: "trainer_restart"}.get(fault.component, "gateway_restart")
        unused = self.source.unused()  # async: groups generated ahead, taken from the feed already
        self.not_trained.update(dict.fromkeys(unused, reason))
        retired = self.feed.retire(reason) + len(unused)
        self.source = self._new_source()
        if self._stepping and self.state.step < self.cfg.run.steps:
            self.source.begin(self.state.step)
        self.supervisor.recovered(
            record,
            f"{action}; generation redone from task {self.state.watermark} (attempt "
            f"{self.feed.attempt}), {retired} samples of abandoned groups set aside",
            fault.started,
        )

    def _restore_trainer(self) -> str:
        """New trainer ranks; the latest checkpoint's trainer and run state (none yet: the run's
        start); its weights onto the engines. Steps after it are undone: their samples are
        recorded as not trained (`trainer_restart`), their groups generated again."""
        self.cluster.replace_trainer()
        latest = self.out / "checkpoints" / "latest"
        ckpt = self.out / "checkpoints" / latest.read_text().strip() if latest.is_file() else None
        if ckpt is not None:
            self.state = RunState.load(ckpt / "state.json")
            self.restore(ckpt)
        else:
            before = [r for r in self.state.rows if r.get("train/step") == 0.0]  # evaluate_before's
            self.state = copy.deepcopy(self.initial)
            self.state.rows = before or self.state.rows
            self.waiter.get(self.cluster.trainer_call("sync_weights"), "syncing the start weights")
            self._note_engine_weights()
        for record in [r for r in self.trained if r.step >= self.state.step]:
            self.not_trained.update(dict.fromkeys(record.sample_ids, "trainer_restart"))
        self.trained = [r for r in self.trained if r.step < self.state.step]
        self.earlier_samples = [s for s in self.earlier_samples if s["step"] <= self.state.step]
        if self.last_step > self.state.step:
            self.last_samples, self.last_step = [], 0
        self.counts = Counter(self.state.counts)
        self.feed.cursors = list(self.state.cursors)  # read again: the feed's seen-set skips them
        # async mode: a sync cut short may have left it paused (resuming an unpaused one is a no-op)
        self.waiter.call(self.cluster.resume_gateway, "resuming the gateway")
        where = ckpt.name if ckpt is not None else "the run's start"
        return f"trainer ranks rebuilt and resumed from {where} (step {self.state.step})"

    def checkpoint_due(self, step: int) -> bool:
        """Checkpoint after this step? Every `run.checkpoint_every` steps, and after the last."""
        done, every = step + 1, self.cfg.run.checkpoint_every
        return bool(every and done % every == 0) or done == self.cfg.run.steps

    def checkpoint(self) -> None:
        """The trainer's state, then the run's; `latest` moves once both are written; then the
        gateway's spool is told it may delete what the checkpoint holds."""
        ckpt, step = checkpoint_dir(self.cfg, self.state), self.state.step - 1
        self.at("checkpoint", step)
        self.waiter.begin(f"checkpoint {ckpt.name}")
        self.waiter.get(self.cluster.trainer_call("save", str(ckpt / "trainer")), "saving the trainer")
        commit_checkpoint(self.cfg, self.state, ckpt)
        self.at("checkpoint_saved", step)
        cursors = list(self.state.cursors)  # a resume reads after them: each spool may delete up to its own
        self.waiter.call(
            lambda: self.feed.ack(cursors), "acknowledging the checkpoint to the gateway's spool"
        )

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, float]:
        """Greedy accuracy on `env.eval_tasks` held-out tasks (`EVAL_SEED`), with the engines' weights."""
        self.waiter.begin(f"held-out evaluation ({tag})")
        ref = self.cluster.rollout.evaluate.remote(
            self.cfg.env.eval_tasks, EVAL_SEED, tag, self.cfg.env.concurrency
        )
        try:
            result = self.waiter.get([ref], "generation", redo=True)[0]
        except Replaced as fault:
            if fault.component == TRAINER:
                raise
            self.recover(fault)  # a new runner (and source): the evaluation again, whole
            return self.evaluate(tag)
        kinds = "".join(
            f", {k.removeprefix('accuracy/')} {v:.3f}" for k, v in result.items() if k.startswith("accuracy/")
        )
        _print(
            f"eval {tag}: accuracy {result['accuracy']:.3f}{kinds} on {int(result['tasks'])} held-out "
            f"tasks (greedy, {result['wall_s']:.1f} s)",
            None,
        )
        return result

    def evaluate_after(self) -> None:
        """Held-out accuracy after the last step: logged, and on the last step's row."""
        state = self.state
        self.eval_after = self.evaluate("after")
        row = eval_row(self.eval_after)
        self._log_held(row)
        if state.rows and state.step > 0:
            state.rows[-1].update(row)

    def _log_held(self, extra: dict[str, float]) -> None:
        """The held last step's row with `extra` in it (one row per step); `extra` alone at the
        run's step when no row is held (a run resumed after its last step)."""
        held, self._held_row = self._held_row, None
        if held is not None:
            self.tracker.log({**held[0], **extra}, held[1])
        elif extra:
            self.tracker.log(extra, self.state.step)

    def evaluate_teacher(self) -> float | None:
        """The teacher's held-out accuracy, for reference. Runs after the last checkpoint: the
        teacher's weights replace the student's on every engine (through the trainer's weight
        sync: pause, update, flush, version check). Only a megatron-mode teacher has the student's
        architecture; any failure is a warning, never the run's end."""
        cfg = self.cfg
        if cfg.trainer.opd.teacher_mode != "megatron":
            log.info("teacher not evaluated: trainer.opd.teacher_mode is %s", cfg.trainer.opd.teacher_mode)
            return None
        if cfg.trainer.lora.enabled:  # every call names the adapter, which would adapt the teacher too
            log.info("teacher not evaluated: with trainer.lora the gateway serves the policy adapter on "
                     "every call; `palaestra eval` against an engine serving the teacher measures it")  # fmt: skip
            return None
        from palaestra.models import resolve_model

        try:
            self.cluster.load_engine_weights(resolve_model(cfg.model.teacher), "teacher")
            return self.evaluate("teacher")["accuracy"]
        except Exception as exc:  # a reference number: report, never fail the finished run
            log.warning("teacher not evaluated: %s", exc)
            return None

    # -- the end -------------------------------------------------------------------------------
    def result(self) -> RunResult:
        """What the run did (the engines' versions are read now)."""
        self.waiter.begin("the run's result")
        step, version, cursors = self.start
        return RunResult(
            output_dir=self.out,
            start_step=step,
            start_weight_version=version,
            start_cursors=cursors,
            state=self.state,
            engine_versions_start=self.engine_versions_start,
            engine_versions_end=self._engine_versions(),
            trained=self.trained,
            faults=[f.to_dict() for f in self.supervisor.faults],
            not_trained=self._not_trained(),
            eval_before=self.eval_before,
            eval_after=self.eval_after,
            startup_s=dict(self.cluster.startup_s),
        )

    def _engine_versions(self) -> list[str]:
        from palaestra.trainer.weight_sync import WeightSyncError  # what a read raises after its retries

        return self.waiter.call(
            self.cluster.engine_versions, "reading the engines' versions", unreachable=(WeightSyncError,)
        )

    def _not_trained(self) -> dict[str, str]:
        """Every sample of this launch read and not trained, with its reason (a last read first:
        the sessions aborted after a fault are spooled late; groups generated ahead that no step
        took are `unused_at_end`)."""
        try:
            self.waiter.call(self.feed.poll, "reading the last samples")
        except RunFailed as exc:  # the run is trained and checkpointed: report what was read
            log.warning("the samples spooled last are not accounted for: %s", exc)
        left = [*self.feed.buffer, *self.source.unused()]  # generated ahead (async), never trained
        return {**self.feed.dropped, **dict.fromkeys(left, "unused_at_end"), **self.not_trained}

    def report(self, result: RunResult) -> RunResult:
        """reward_curve.png, viewer.html (a few samples of every step, the last step's with the teacher's logprobs)
        and the summary line, printed; all three are set on `result`, which is returned."""
        from palaestra.orchestrator.report import plot_reward_curve, summary_line
        from palaestra.orchestrator.viewer import write_trajectory_viewer

        cfg, rows = self.cfg, self.state.rows
        result.reward_curve = plot_reward_curve(
            rows,
            self.out / "reward_curve.png",
            title=f"{cfg.run.name}: reward per step",
            teacher_accuracy=result.teacher_accuracy,
            eval_tasks=cfg.env.eval_tasks,
        )
        if self.last_samples:
            shown = self.last_samples[:64]
            samples = [{**s.to_dict(), "step": self.last_step} for s in shown]
            self.waiter.begin("the trajectory viewer")
            teacher = self.waiter.get(
                self.cluster.trainer_call("teacher_logprobs", [], rank0_args=(shown,)), "teacher scoring"
            )[0]
            for s, t in zip(samples, teacher or [], strict=False):
                s["teacher_logprobs"] = t
            from transformers import AutoTokenizer

            from palaestra.models import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.model.student))
            result.viewer = write_trajectory_viewer(
                self.earlier_samples + samples,
                tokenizer,
                self.out / "viewer.html",
                title=f"{cfg.run.name}: samples of every step"
                + (" (the last one with teacher logprobs)" if any(teacher or []) else ""),
            )
        result.summary = summary_line(
            rows,
            steps=self.state.step,
            mode=cfg.run.mode,
            eval_after=result.eval_after,
            teacher_accuracy=result.teacher_accuracy,
            weight_version=self.state.weight_version,
            engines=len(result.engine_versions_end),
            counts=self.counts,
            output_dir=self.out,
            faults=self.supervisor.faults,
        )
        self._write_faults()
        self._note_step(None, [], result.not_trained or {})  # what the run's end found not trained
        if late := self.supervisor.new_counters():  # faults after the last step's row (its checkpoint)
            self.tracker.log(late, self.state.step)
        _print(result.summary, None)
        return result


def eval_row(result: dict[str, float]) -> dict[str, float]:
    """An evaluation's accuracies as a metrics row: ``eval/accuracy`` and, for tasks of several
    kinds, ``eval/accuracy/<kind>``."""
    return {f"eval/{k}": v for k, v in result.items() if k == "accuracy" or k.startswith("accuracy/")}


def _progress(steps: int, done: int):
    """A progress bar across steps on a terminal (console lines print above it); None otherwise."""
    if not sys.stderr.isatty() or steps == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=done, desc="train", unit="step", dynamic_ncols=True)


def _print(line: str, bar) -> None:
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)
