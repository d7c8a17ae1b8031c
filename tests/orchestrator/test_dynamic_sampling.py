"""Dynamic sampling (`trainer.dynamic_sampling`), without Ray: the sync and async sources
(orchestrator/modes.py) drop groups whose rewards are all equal and refill the step's batch.

The sources talk to the environment runner, the sample feed and the waiter; here each is a TEST
DOUBLE (`FakeRunner`, `FakeFeed`, `FakeWaiter`) whose task `i` has a fixed group: flat (every
reward equal) when `i` is in `flat`, else rewards 0 and 1. The runner models async admission as the
real one does: it starts a group only while fewer than `allowed` have been started, so a source
that forgets to admit more waits forever, which the fake waiter reports at once instead. The real
runner and feed are tested in tests/orchestrator/test_batching.py and end to end on Ray in
tests/orchestrator/test_train_e2e.py.
"""

from __future__ import annotations

import pytest

from palaestra.config import ConfigError, load_config
from palaestra.orchestrator.batching import GroupRecord
from palaestra.orchestrator.errors import Replaced
from palaestra.orchestrator.metrics import rollout_metrics
from palaestra.orchestrator.modes import AsyncSource, SyncSource
from palaestra.sample import Sample

GROUP = 4  # samples per task


def _group(index: int, flat: set[int]) -> tuple[GroupRecord, list[Sample]]:
    rewards = [1.0] * GROUP if index in flat else [float(k % 2) for k in range(GROUP)]
    ids = [f"s{index}-{k}" for k in range(GROUP)]
    samples = [
        Sample(
            sample_id=sid,
            session_id=sid,
            group_id=f"env/t{index}/r.{index}",
            env="e",
            task_id=f"t{index}",
            tokens=[1, 2, 3],
            prompt_len=2,
            loss_mask=[1],
            rollout_logprobs=[-1.0],
            weight_versions=["0"],
            reward=r,
        )
        for sid, r in zip(ids, rewards, strict=True)
    ]
    record = GroupRecord(index, f"t{index}", f"env/t{index}/r.{index}", ids, rewards, {"completed": GROUP},
                         {}, GROUP, 0.0, 1.0)  # fmt: skip
    return record, samples


class _Remote:
    """A method called as Ray's `actor.method.remote(...)`; the 'ref' is the result itself."""

    def __init__(self, fn):
        self.remote = fn


class FakeRunner:
    """TEST DOUBLE of the environment runner (`RolloutWorker`): sync `run_groups`, and the async
    stream's admission (`start_stream`, `allow`, `take_finished`)."""

    def __init__(self, flat: set[int]):
        self.flat, self.launched, self.groups = flat, [], {}
        self.next, self.started, self.allowed = 0, 0, 0
        self.run_groups = _Remote(self._run_groups)
        self.start_stream = _Remote(self._start_stream)
        self.allow = _Remote(self._allow)
        self.take_finished = _Remote(self._take_finished)

    def _made(self, index: int) -> GroupRecord:
        record, samples = _group(index, self.flat)
        self.groups[record.group_id] = samples
        return record

    def _run_groups(self, indices, attempt):
        self.launched.append(list(indices))
        return [self._made(i) for i in indices]

    def _start_stream(self, first, skip, allowed, attempt):
        self.next, self.allowed = first, allowed

    def _allow(self, allowed):
        self.allowed = max(self.allowed, allowed)

    def _take_finished(self):
        done = []
        while self.started < self.allowed:  # every admitted group finishes at once
            done.append(self._made(self.next))
            self.next += 1
            self.started += 1
        return done


class FakeFeed:
    """TEST DOUBLE of `SampleFeed`: every group's samples are read already."""

    def __init__(self, runner: FakeRunner):
        self.runner = runner

    def poll(self) -> int:
        return 0

    def claim(self, record):
        return self.runner.groups.pop(record.group_id)


class FakeWaiter:
    """TEST DOUBLE of `Waiter`: results are there at once; a condition that does not hold after a
    few polls would hold never (nothing here runs in the background), so it fails the test."""

    deadline = float("inf")

    def get(self, refs, phase, **_):
        return list(refs)

    def call(self, fn, phase, **_):
        return fn()

    def wait_until(self, ready, phase, progress, **_):
        for _ in range(3):
            if ready():
                return
        raise AssertionError(f"{phase} would wait until the step timeout: {progress()}")


class FakeCluster:
    def __init__(self, runner: FakeRunner):
        self.rollout = runner


def _source(cls, flat: set[int], *overrides: str, monkeypatch=None):
    cfg = load_config(
        None,
        ["model.student=tiny", "env.tasks_per_step=4", f"env.samples_per_task={GROUP}", *overrides],
    )
    runner = FakeRunner(flat)
    if monkeypatch is not None:  # AsyncSource reads the runner's finished groups with ray.get
        import ray

        monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    return cls(cfg, FakeCluster(runner), FakeFeed(runner), FakeWaiter()), runner


DYNAMIC = ("trainer.dynamic_sampling.enabled=true",)


# ----------------------------------------------------------------------------------------------
# sync: generate more before the step
# ----------------------------------------------------------------------------------------------
def test_sync_refills_the_dropped_groups_with_new_tasks_until_the_step_is_full():
    source, runner = _source(SyncSource, {0, 2, 4}, *DYNAMIC)
    batch = source.batch(0, trainer_version=0)
    # round 1: tasks 0-3, two flat; round 2: two more (4 flat, 5); round 3: one more (6)
    assert runner.launched == [[0, 1, 2, 3], [4, 5], [6]]
    assert [g.task_index for g in batch.groups] == [1, 3, 5, 6] and batch.rounds == 3
    assert [g.task_index for g in batch.considered] == list(range(7))  # all consumed, none redone
    assert all(len({s.reward for s in batch.samples if s.task_id == f"t{i}"}) == 2 for i in (1, 3, 5, 6))
    m = rollout_metrics(batch)
    assert (m["rollout/groups"], m["rollout/groups_dropped"], m["rollout/rounds"]) == (4.0, 3.0, 3.0)
    assert m["rollout/samples_generated"] == 28.0 and m["rollout/generated_per_trained"] == 28 / 16
    assert m["rollout/dropped_zero_variance"] == 12.0
    assert source.batch(1, trainer_version=1).considered[0].task_index == 7  # the next step goes on


def test_sync_stops_after_max_rounds_and_trains_what_it_has():
    source, runner = _source(
        SyncSource, set(range(1, 100)), *DYNAMIC, "trainer.dynamic_sampling.max_rounds=2"
    )
    batch = source.batch(0, trainer_version=0)
    assert runner.launched == [[0, 1, 2, 3], [4, 5, 6]] and batch.rounds == 2
    assert [g.task_index for g in batch.groups] == [0]
    assert rollout_metrics(batch)["rollout/generated_per_trained"] == 7.0


def test_without_dynamic_sampling_sync_trains_every_group_of_one_round():
    source, runner = _source(SyncSource, {0, 2})
    batch = source.batch(0, trainer_version=0)
    assert runner.launched == [[0, 1, 2, 3]] and len(batch.groups) == 4 and batch.rounds == 1
    assert rollout_metrics(batch)["rollout/generated_per_trained"] == 1.0
    # the filter alone (env.filter_zero_variance_groups) drops them and does not refill, as before
    source, runner = _source(SyncSource, {0, 2}, "env.filter_zero_variance_groups=true")
    assert [g.task_index for g in source.batch(0, 0).groups] == [1, 3] and runner.launched == [[0, 1, 2, 3]]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "reinforce_pp_baseline"])
def test_every_reward_estimator_drops_flat_groups(estimator):
    source, _ = _source(SyncSource, {0}, *DYNAMIC, f"trainer.advantage_estimator={estimator}")
    assert [g.task_index for g in source.batch(0, 0).groups] == [1, 2, 3, 4]


OPD = ("model.teacher=tiny", "trainer.opd.kl_coef=1.0", "trainer.opd.teacher_mode=megatron")


def test_an_opd_only_run_keeps_flat_groups_its_teacher_still_teaches():
    # advantage_estimator none: rewards are ignored, the teacher's per-token signal needs no variance
    source, runner = _source(SyncSource, {0, 2}, *DYNAMIC, *OPD, "trainer.advantage_estimator=none")
    batch = source.batch(0, 0)
    assert runner.launched == [[0, 1, 2, 3]] and [g.task_index for g in batch.groups] == [0, 1, 2, 3]
    assert "zero_variance" not in batch.dropped.values()
    # GRPO + OPD: the reward's advantage needs variance, so flat groups go and are refilled
    source, runner = _source(SyncSource, {0, 2}, *DYNAMIC, *OPD)
    assert [g.task_index for g in source.batch(0, 0).groups] == [1, 3, 4, 5]


# ----------------------------------------------------------------------------------------------
# a fault while the batch is being made: its groups taken so far are reported as unused
# ----------------------------------------------------------------------------------------------
class DyingWaiter(FakeWaiter):
    """TEST DOUBLE: the environment runner dies (`Replaced`) at the `dies_at`-th wait for samples."""

    def __init__(self, dies_at: int):
        self.waits, self.dies_at = 0, dies_at

    def wait_until(self, ready, phase, progress, **kw):
        self.waits += 1
        if self.waits == self.dies_at:
            raise Replaced("environment runner", "killed", 0.0)
        return super().wait_until(ready, phase, progress, **kw)


def _ids(*tasks: int) -> list[str]:
    return [f"s{i}-{k}" for i in tasks for k in range(GROUP)]


def test_sync_reports_the_rounds_a_fault_abandoned_mid_batch_as_unused():
    source, _ = _source(SyncSource, {0, 2}, *DYNAMIC)
    source.waiter = DyingWaiter(dies_at=2)  # round 1 read (tasks 0-3, two flat), round 2 not
    with pytest.raises(Replaced):
        source.batch(0, trainer_version=0)
    assert sorted(source.unused()) == _ids(0, 1, 2, 3)  # the run records them with the fault's reason
    source.waiter = FakeWaiter()
    source.batch(1, trainer_version=0)
    assert source.unused() == []  # a batch handed over is the run's to account for


def test_async_reports_the_groups_a_fault_abandoned_mid_batch_as_unused(monkeypatch):
    # the chaos soak's lost group: taken into the step's batch, then the runner died before the
    # batch was full; neither the feed nor `ready` held it any more, so no reason was recorded
    source, _ = _source(AsyncSource, set(), *ASYNC, monkeypatch=monkeypatch)
    source.begin(0)
    source.waiter = DyingWaiter(dies_at=2)  # task 0 taken into the batch, then the runner dies
    with pytest.raises(Replaced):
        source.batch(0, trainer_version=0)
    assert sorted(source.unused()) == sorted(_ids(*range(8)))  # task 0 and the 7 generated ahead
    source.waiter = FakeWaiter()
    assert [g.task_index for g in source.batch(0, trainer_version=0).groups] == [1, 2, 3, 4]
    assert sorted(source.unused()) == sorted(_ids(5, 6, 7))  # only those ahead, not the handed-over batch


# ----------------------------------------------------------------------------------------------
# async: keep sampling until the step has its informative groups
# ----------------------------------------------------------------------------------------------
ASYNC = ("run.mode=async", "run.max_staleness=1")


def test_async_admits_a_new_group_for_each_dropped_one(monkeypatch):
    # 9 of the first 12 tasks are flat: more than the admission limit's 2 steps x 4 groups must be
    # looked at before the first sync; without admitting replacements the step would wait forever
    flat = {0, 1, 2, 4, 5, 6, 8, 9, 10}
    source, runner = _source(AsyncSource, flat, *ASYNC, *DYNAMIC, monkeypatch=monkeypatch)
    source.begin(0)
    batch = source.batch(0, trainer_version=0)
    assert [g.task_index for g in batch.groups] == [3, 7, 11, 12] and batch.rounds == 4
    # admission rose with each drop: 11 groups taken at the last one (task 10), plus 2 steps ahead
    assert len(batch.considered) == 13 and runner.allowed == 11 + 8
    m = rollout_metrics(batch)
    assert m["rollout/groups_dropped"] == 9.0 and m["rollout/generated_per_trained"] == 13 / 4


def test_async_stops_after_max_rounds_of_groups(monkeypatch):
    source, _ = _source(AsyncSource, set(range(100)), *ASYNC, *DYNAMIC,
                        "trainer.dynamic_sampling.max_rounds=2", monkeypatch=monkeypatch)  # fmt: skip
    source.begin(0)
    batch = source.batch(0, trainer_version=0)
    assert batch.groups == [] and len(batch.considered) == 8 and batch.rounds == 2
    assert "rollout/generated_per_trained" not in rollout_metrics(batch)  # nothing trained: no ratio


def test_async_opd_only_keeps_flat_groups(monkeypatch):
    source, _ = _source(AsyncSource, {0, 1}, *ASYNC, *DYNAMIC, *OPD, "trainer.advantage_estimator=none",
                        monkeypatch=monkeypatch)  # fmt: skip
    source.begin(0)
    batch = source.batch(0, trainer_version=0)
    assert [g.task_index for g in batch.groups] == [0, 1, 2, 3] and batch.rounds == 1


# ----------------------------------------------------------------------------------------------
# bad input, at config load
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.dynamic_sampling.enabled=maybe"], "trainer.dynamic_sampling.enabled: expected bool"),
        (["trainer.dynamic_sampling.enabled=3"], "trainer.dynamic_sampling.enabled: expected bool"),
        (["trainer.dynamic_sampling.max_rounds=two"], "trainer.dynamic_sampling.max_rounds: expected int"),
        (["trainer.dynamic_sampling.max_rounds=2.5"], "trainer.dynamic_sampling.max_rounds: expected int"),
        (
            ["trainer.dynamic_sampling.max_rounds=0"],
            "trainer.dynamic_sampling.max_rounds: must be between 1 and 1000; got 0",
        ),
        (
            ["trainer.dynamic_sampling.max_rounds=-1"],
            "trainer.dynamic_sampling.max_rounds: must be between 1 and 1000; got -1",
        ),
        (
            ["trainer.dynamic_sampling.max_rounds=10000000000"],
            "trainer.dynamic_sampling.max_rounds: must be between 1 and 1000",
        ),
        (["trainer.dynamic_sampling=[1]"], "trainer.dynamic_sampling: expected a mapping"),
        (["trainer.dynamic_sampling.max_round=2"], "did you mean 'trainer.dynamic_sampling.max_rounds'"),
        (
            [*DYNAMIC, "run.mode=one_step_off"],
            "trainer.dynamic_sampling.enabled: run.mode one_step_off trains each batch",
        ),
        (
            [*DYNAMIC, *OPD, "env.samples_per_task=1", "trainer.advantage_estimator=grpo"],
            "trainer.dynamic_sampling.enabled: a group of 1 sample always has zero variance",
        ),
    ],
)
def test_bad_settings_are_one_line_errors_at_load(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.student=tiny", *overrides])
    assert expected in str(err.value)


def test_an_opd_only_run_of_groups_of_one_may_enable_it():
    cfg = load_config(None, ["model.student=tiny", *DYNAMIC, *OPD, "env.samples_per_task=1",
                             "trainer.advantage_estimator=none"])  # fmt: skip
    assert cfg.trainer.dynamic_sampling.enabled and not cfg.trainer.rewards_train
