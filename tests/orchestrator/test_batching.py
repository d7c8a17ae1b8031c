"""What trains, without Ray: `palaestra.orchestrator.batching` (staleness, filters, the sample feed),
the task order and consumption a run keeps (`TaskSource`, `RunState`) and a step's metrics.

The sample feed reads a stand-in for the gateway's `/samples` endpoint (a TEST DOUBLE serving a
fixed list with the real endpoint's paging fields); the gateway's own endpoint is tested in the
gateway tests and end to end in tests/orchestrator/test_train_e2e.py.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from fastapi import FastAPI

from palaestra.orchestrator.batching import Batch, GroupRecord, SampleFeed, sample_lag, select_batch
from palaestra.orchestrator.checkpoint import RunState
from palaestra.orchestrator.metrics import console_line, rollout_metrics
from palaestra.orchestrator.rollout_worker import TaskSource
from palaestra.sample import Sample
from palaestra.sdk import Environment, Task
from tests.support.servers import ThreadServer


def _sample(
    sid: str, versions: list[str], reward: float = 0.0, group_id: str = "g", status: str = "completed"
):
    n = len(versions)
    return Sample(
        sample_id=sid,
        session_id=sid,
        group_id=group_id,
        env="e",
        task_id="t",
        tokens=[1, 2, *range(3, 3 + n)],
        prompt_len=2,
        loss_mask=[1 if v else 0 for v in versions],
        rollout_logprobs=[-1.0 if v else 0.0 for v in versions],
        weight_versions=versions,
        reward=reward,
        status=status,
    )


def _record(index: int, ids: list[str], rewards: list[float] | None = None, statuses=None):
    return GroupRecord(
        index,
        f"t{index}",
        f"env/t{index}/r.{index}",
        ids,
        rewards if rewards is not None else [0.0] * len(ids),
        statuses or {},
        {},
        0,
        0.0,
        1.0,
    )


# ----------------------------------------------------------------------------------------------
# Staleness and filters
# ----------------------------------------------------------------------------------------------
def test_sample_lag_is_measured_from_the_oldest_sampled_token():
    assert sample_lag(_sample("a", ["3", "", "4"]), 5) == 2  # the masked token has no version
    assert sample_lag(_sample("b", ["5", "5"]), 5) == 0
    assert sample_lag(_sample("c", ["default"]), 5) == math.inf  # an engine never given a version


def test_select_batch_drops_or_masks_stale_samples_and_filters_flat_groups():
    groups = [
        (_record(0, ["a", "b"]), [_sample("a", ["1"], 1.0), _sample("b", ["3"], 0.0)]),
        (_record(1, ["c", "d"]), [_sample("c", ["3"], 1.0), _sample("d", ["3"], 1.0)]),
    ]
    dropped = select_batch(groups, 3, max_staleness=1, stale_policy="drop", filter_zero_variance=True)
    # group 0 loses "a" (2 versions old) and then has one reward left: filtered; so is group 1
    assert dropped.samples == [] and dropped.counts["stale_dropped"] == 1
    assert dropped.counts["groups_zero_variance"] == 2 and len(dropped.considered) == 2
    # and each sample that does not train says why
    assert dropped.dropped == {"a": "stale", "b": "zero_variance", "c": "zero_variance", "d": "zero_variance"}

    masked = select_batch(groups, 3, max_staleness=1, stale_policy="mask", filter_zero_variance=False)
    assert [s.sample_id for s in masked.samples] == ["a", "b", "c", "d"]
    assert masked.samples[0].loss_mask == [0] and masked.counts["stale_masked"] == 1
    assert masked.lags == [2, 0, 0, 0] and groups[0][1][0].loss_mask == [1]  # the original is untouched
    assert masked.dropped == {"a": "stale_masked"}


def test_a_batch_every_session_of_which_failed_says_why():
    failing = _record(0, [], statuses={"failed": 2})
    failing.errors = ["GatewayError: the engine answered without meta_info.routed_experts"] * 2
    batch = select_batch([(failing, [])], 0, max_staleness=1, stale_policy="drop", filter_zero_variance=True)
    assert batch.samples == [] and batch.counts["groups_empty"] == 1
    assert batch.why_empty() == (
        "{'groups_empty': 1}; the sessions' errors: GatewayError: the engine answered without "
        "meta_info.routed_experts"
    )
    assert select_batch([], 0, 1, "drop", True).why_empty() == "{}"


def test_rollout_metrics_count_what_the_filters_left_out():
    groups = [
        (_record(0, ["a", "b"], [1.0, 0.0], {"completed": 2, "failed": 1}), [_sample("a", ["2"], 1.0)]),
        (_record(1, ["c"], [1.0], {"completed": 1}), [_sample("c", ["0"], 1.0)]),
    ]
    groups[0][1].append(_sample("b", ["2", "2"], 0.0))
    batch = Batch.empty()
    batch.extend(select_batch(groups, 2, max_staleness=1, stale_policy="drop", filter_zero_variance=False))
    m = rollout_metrics(batch)
    assert [s.sample_id for s in batch.samples] == ["a", "b"] and batch.counts == Counter(
        stale_dropped=1, groups_empty=1
    )
    assert batch.session_statuses() == Counter(completed=3, failed=1)  # every group looked at
    assert (m["rollout/samples"], m["rollout/groups"], m["rollout/sampled_tokens"]) == (2.0, 1.0, 3.0)
    assert m["rollout/reward_mean"] == 0.5 and m["rollout/dropped"] == 1.0
    assert m["rollout/dropped_stale"] == 1.0 and batch.dropped == {"c": "stale"}
    from palaestra.orchestrator.report import dropped_totals

    rows = [m, {**m, "rollout/dropped_zero_variance": 2.0}]
    assert dropped_totals(rows) == {"stale": 2, "zero_variance": 2}
    assert (m["rollout/sessions_completed"], m["rollout/sessions_failed"]) == (3.0, 1.0)
    assert math.isnan(rollout_metrics(Batch.empty())["rollout/reward_mean"])


def test_rollout_metrics_give_each_kinds_reward_when_tasks_are_of_several():
    """Tasks with a `kind` (a reasoning-gym dataset, a game, a mix's family): a reward per kind."""
    records = [_record(0, ["a", "b"], [1.0, 0.0]), _record(1, ["c"], [1.0]), _record(2, ["d"], [0.0])]
    for record, kind in zip(records, ["maze", "maze", "chain_sum"], strict=True):
        record.kind = kind
    batch = Batch([], records, [], Counter())
    m = rollout_metrics(batch)
    assert m["rollout/reward_mean/maze"] == 2 / 3 and m["rollout/groups/maze"] == 2.0
    assert m["rollout/reward_mean/chain_sum"] == 0.0 and m["rollout/groups/chain_sum"] == 1.0
    records[2].kind = "maze"  # one kind only: the overall reward says it all
    assert not any("/maze" in k for k in rollout_metrics(batch))


# ----------------------------------------------------------------------------------------------
# The sample feed
# ----------------------------------------------------------------------------------------------
def _samples_endpoint(records: list[dict]) -> FastAPI:
    """TEST DOUBLE of the gateway's `GET /samples?after=&limit=` (same fields, fixed records)."""
    app = FastAPI()

    @app.get("/samples")
    async def samples(after: int = 0, limit: int = 100) -> dict:
        page = [(i + 1, r) for i, r in enumerate(records) if i + 1 > after][:limit]
        return {
            "samples": [r for _, r in page],
            "cursors": [c for c, _ in page],
            "cursor": page[-1][0] if page else after,
            "last_cursor": len(records),
        }

    return app


def test_sample_feed_keeps_this_launchs_trainable_samples_once_until_claimed():
    ours, other, evaluation = "env/t0/run1.0", "env/t0/run0.0", "env/t0/eval-run1-before"
    records = [
        _sample("a", ["0"], group_id=ours).to_dict(),
        _sample("a", ["0"], group_id=ours).to_dict(),  # a duplicate (a retried write)
        _sample("b", ["0"], group_id=ours, status="failed").to_dict(),
        _sample("c", ["0"], group_id=other).to_dict(),  # a crashed earlier launch
        _sample("d", ["0"], group_id=evaluation).to_dict(),
        _sample("e", ["0"], group_id=ours, status="truncated").to_dict(),
    ]
    with ThreadServer(_samples_endpoint(records)) as server:
        feed = SampleFeed(server.url, "key", run_id="run1")
        try:
            assert feed.claim(_record(0, ["a", "e"])) is None  # nothing read yet
            assert feed.poll() == 2 and feed.cursors == [6]
            assert feed.counts == Counter(duplicates=1, status_failed=1, other_run=1, eval=1)
            assert feed.dropped == {"b": "failed", "c": "earlier_launch"}  # an evaluation's: no reason needed
            claimed = feed.claim(_record(0, ["a", "e"]))
            assert [s.sample_id for s in claimed] == ["a", "e"] and feed.buffer == {}
            assert feed.poll() == 0  # the cursor moved on: nothing is read twice
        finally:
            feed.close()


def _sharded_endpoint(shards: list[list[dict]], acks: list[tuple[int, int]]) -> FastAPI:
    """TEST DOUBLE of a front's ``/samples?shard=`` and ``/samples/ack?shard=`` over fixed spools."""
    app = FastAPI()

    @app.get("/samples")
    async def samples(shard: int, after: int = 0, limit: int = 100) -> dict:
        records = shards[shard]
        page = [(i + 1, r) for i, r in enumerate(records) if i + 1 > after][:limit]
        return {
            "samples": [r for _, r in page],
            "cursor": page[-1][0] if page else after,
            "last_cursor": len(records),
        }

    @app.post("/samples/ack")
    async def ack(shard: int, body: dict) -> dict:
        acks.append((shard, body["cursor"]))
        return {"acked": body["cursor"]}

    return app


def test_the_feed_reads_and_acknowledges_every_shards_spool_by_its_own_cursor():
    g = "env/t0/run1.0"
    spools = [
        [_sample("a", ["0"], group_id=g).to_dict(), _sample("b", ["0"], group_id=g).to_dict()],
        [_sample("c", ["0"], group_id=g).to_dict()],
    ]
    acks: list[tuple[int, int]] = []
    with ThreadServer(_sharded_endpoint(spools, acks)) as server:
        feed = SampleFeed(server.url, "key", run_id="run1", cursors=[1, 0], shards=2)  # a resume
        try:
            assert feed.poll() == 2 and feed.cursors == [2, 1]  # shard 0's "a" was read before
            assert [s.sample_id for s in feed.claim(_record(0, ["b", "c"]))] == ["b", "c"]
            spools[1].append(_sample("d", ["0"], group_id=g).to_dict())
            assert feed.poll() == 1 and feed.cursors == [2, 2]
            feed.ack(feed.cursors)
            assert acks == [(0, 2), (1, 2)]
        finally:
            feed.close()
    with pytest.raises(ValueError, match="resumes with the gateway.shards it was checkpointed with"):
        SampleFeed("http://x", "key", run_id="run1", cursors=[3], shards=2)


def test_failed_and_aborted_samples_are_counted_in_the_step_that_takes_their_group():
    g0, g1 = "env/t0/run1.0", "env/t1/run1.1"
    records = [
        _sample("a", ["0"], reward=1.0, group_id=g0).to_dict(),
        _sample("b", ["0"], group_id=g0, status="failed").to_dict(),
        _sample("c", ["0"], group_id=g0).to_dict(),
        _sample("d", ["0"], group_id=g1, status="aborted").to_dict(),
        _sample("e", ["0"], group_id=g1).to_dict(),
    ]
    with ThreadServer(_samples_endpoint(records)) as server:
        feed = SampleFeed(server.url, "key", run_id="run1")
        try:
            feed.poll()
            r0 = GroupRecord(
                0, "t0", g0, ["a", "c"], [1.0, 0.0], {"completed": 2, "failed": 1}, {}, 0, 0.0, 1.0
            )
            r1 = GroupRecord(1, "t1", g1, ["e"], [0.0], {"completed": 1, "aborted": 1}, {}, 0, 0.0, 1.0)
            step1 = select_batch([(r0, feed.claim(r0))], 0, 1, "drop", filter_zero_variance=True)
            step2 = select_batch([(r1, feed.claim(r1))], 0, 1, "drop", filter_zero_variance=True)
        finally:
            feed.close()
    assert step1.dropped == {"b": "failed"} and [s.sample_id for s in step1.samples] == ["a", "c"]
    assert step2.dropped == {"d": "aborted", "e": "zero_variance"}
    from palaestra.orchestrator.report import dropped_totals

    rows = [rollout_metrics(step1), rollout_metrics(step2)]
    assert rows[0]["rollout/dropped_failed"] == 1.0 and "rollout/dropped_aborted" not in rows[0]
    assert rows[1]["rollout/dropped_aborted"] == 1.0
    assert dropped_totals(rows) == {"failed": 1, "aborted": 1, "zero_variance": 1}


# ----------------------------------------------------------------------------------------------
# Task order, consumption, the console line
# ----------------------------------------------------------------------------------------------
class Finite(Environment):
    name = "finite"

    def tasks(self, seed):
        return [Task(task_id=f"{seed}-{i}") for i in range(3)]

    async def rollout(self, session, task) -> float:
        raise AssertionError("not run here")


def test_task_source_wraps_a_finite_list_and_run_state_tracks_consumed_tasks():
    source = TaskSource(Finite(), seed=10)
    assert [source.get(i).task_id for i in [0, 1, 2, 3, 4, 1, 7]] == [
        "10-0", "10-1", "10-2", "11-0", "11-1", "10-1", "12-1",
    ]  # fmt: skip
    state = RunState()
    state.consume([0, 2, 5])
    assert (state.watermark, state.consumed_above) == (1, [2, 5])
    state.consume([1, 3, 4])
    assert (state.watermark, state.consumed_above) == (6, [])


def test_console_line_reads_as_one_line():
    line = console_line(3, 20, {"rollout/reward_mean": 0.25, "rollout/reward_std": 0.5, "train/loss": 1e-5})
    assert line == "step 3/20 reward 0.250±0.500 loss 1.00e-05"


# ----------------------------------------------------------------------------------------------
# After a fault: abandoned groups, redone groups, the environment runner's session ledger
# ----------------------------------------------------------------------------------------------
def test_a_retired_attempt_never_trains_and_every_sample_of_it_keeps_a_reason():
    from palaestra.orchestrator.batching import group_attempt
    from palaestra.orchestrator.ledger import group_run_id

    first, redone = f"env/t0/{group_run_id('run1', 0)}", f"env/t0/{group_run_id('run1', 0, 1)}"
    assert (first, redone) == ("env/t0/run1.0", "env/t0/run1.0.a1")
    assert (group_attempt(first), group_attempt(redone), group_attempt("env/t0/eval-run1-x")) == (0, 1, 0)
    records = [
        _sample("a", ["0"], group_id=first).to_dict(),  # read before the fault
        _sample("b", ["0"], group_id=first).to_dict(),  # spooled after it (its session ended late)
        _sample("c", ["0"], group_id=first, status="aborted").to_dict(),  # aborted by the driver
        _sample("d", ["0"], group_id=redone).to_dict(),
    ]
    with ThreadServer(_samples_endpoint(records[:1])) as server:
        feed = SampleFeed(server.url, "key", run_id="run1")
        try:
            feed.poll()
            assert feed.retire("runner_died") == 1 and feed.attempt == 1 and feed.buffer == {}
        finally:
            feed.close()
    with ThreadServer(_samples_endpoint(records)) as server:
        feed.client = type(feed.client)(base_url=server.url, trust_env=False)
        feed.url = server.url
        feed.poll()
        feed.close()
    assert feed.dropped == {"a": "runner_died", "b": "runner_died", "c": "aborted"}
    assert [s.sample_id for s in feed.claim(_record(0, ["d"]))] == ["d"]
    assert feed.counts["retired_runner_died"] == 2


def test_the_runner_ledger_names_the_sessions_left_open(tmp_path):
    from palaestra.orchestrator.ledger import open_sessions

    ledger = tmp_path / "rollout-sessions-0.jsonl"
    assert open_sessions(ledger) == {}
    ledger.write_text(
        '{"open": "s1", "group": "g1"}\n{"open": "s2", "group": "g1"}\n{"done": "s1"}\n'
        '{"open": "s3", "group": "g2"}\n{"done": "s'  # the last line cut by the kill
    )
    assert open_sessions(ledger) == {"s2": "g1", "s3": "g2"}


def test_the_step_ledger_keeps_each_steps_last_record_and_every_reason(tmp_path):
    """Launch A trains steps 1-2 and is killed; B resumes from step 1's checkpoint and redoes step
    2 (A's step 2 samples read back as `earlier_launch`): the final history is B's step 2."""
    from palaestra.orchestrator.ledger import note_step, read_steps

    ledger = tmp_path / "trained.jsonl"
    note_step(ledger, "A", 1, ["a1", "a2"], {"a0": "failed"})
    note_step(ledger, "A", 2, ["a3"], {})
    note_step(ledger, "B", 2, ["b1"], {"a3": "earlier_launch"})
    note_step(ledger, "B", None, [], {"b2": "unused_at_end"})
    with open(ledger, "a") as f:
        f.write('{"launch": "B", "step": 3, "trai')  # a line cut by a kill
    history, reasons = read_steps(ledger)
    assert history == {1: ["a1", "a2"], 2: ["b1"]}
    assert reasons == {"a0": "failed", "a3": "earlier_launch", "b2": "unused_at_end"}


def test_samples_read_before_a_checkpoints_cursor_and_never_trained_get_a_reason_after_a_resume(tmp_path):
    """Async / one-step-off: at a step's end the feed has read samples of groups generated ahead
    (`buffer`) and the source holds groups no step took (`unused`); the checkpoint's cursor is past
    them, so a resumed launch never reads them again. The checkpoint's state names them and the
    resumed launch records them as `earlier_launch` in the step ledger, so none is lost."""
    import json
    from dataclasses import asdict
    from types import SimpleNamespace

    from palaestra.orchestrator.ledger import note_step, read_steps
    from palaestra.orchestrator.loop import Run, earlier_launch

    run = Run.__new__(Run)  # the real end_step, around stand-ins for the feed, the source, the cluster
    run.state, run.trained, run._noted = RunState(step=2, cursors=[5]), [], set()
    run.feed = SimpleNamespace(cursors=[9], buffer={"a7": None, "a8": None}, dropped={"a6": "failed"})
    run.source = SimpleNamespace(unused=lambda: ["a5", "a7"])
    run.cluster = SimpleNamespace(run_id="A", gateway_overhead_s=lambda: 0.0)
    run.not_trained, run.ledger = {}, tmp_path / "trained.jsonl"
    run._times = {"start": 0.0, "batch": 0.5, "train_s": 0.1, "sync_s": 0.1, "gateway_s": 0.0}
    run.end_step(2, Batch.empty())
    assert run.state.unclaimed == ["a5", "a7", "a8"] and run.state.cursors == [9]
    (tmp_path / "state.json").write_text(json.dumps(asdict(run.state)))
    resumed = RunState.load(tmp_path / "state.json")  # launch A killed; B resumes from the checkpoint
    assert earlier_launch(resumed) == dict.fromkeys(["a5", "a7", "a8"], "earlier_launch")
    note_step(run.ledger, "B", 3, ["b1"], earlier_launch(resumed))
    _, reasons = read_steps(run.ledger)
    assert reasons == {"a6": "failed", **dict.fromkeys(["a5", "a7", "a8"], "earlier_launch")}
    assert earlier_launch(RunState()) == {}  # a checkpoint of before (no `unclaimed`): nothing


def test_async_mode_interrupts_weight_syncs_unless_told_to_drain():
    """Partial rollouts are async mode's default: its trainer pauses the engines in abort mode (the
    gateway continues what they return); with run.partial_rollouts=false, and in the other modes,
    the trainer's own sync.pause_mode stands."""
    from palaestra.config import load_config
    from palaestra.orchestrator.cluster import interrupting, trainer_options

    async_cfg = load_config("configs/demo.yaml", ["run.mode=async"])
    assert interrupting(async_cfg) and trainer_options(async_cfg)["sync"]["pause_mode"] == "abort"
    for overrides in (["run.mode=async", "run.partial_rollouts=false"], ["run.mode=one_step_off"], []):
        cfg = load_config("configs/demo.yaml", overrides)
        assert not interrupting(cfg) and trainer_options(cfg)["sync"]["pause_mode"] == "in_place", overrides


def test_a_checkpoint_of_one_gateway_resumes_as_one_shards_cursor(tmp_path):
    import json

    (tmp_path / "state.json").write_text(json.dumps({"step": 2, "cursor": 7}))
    assert RunState.load(tmp_path / "state.json").cursors == [7]
    (tmp_path / "state.json").write_text(json.dumps({"step": 2, "cursors": [3, 4]}))
    assert RunState.load(tmp_path / "state.json").cursors == [3, 4]
    assert RunState().cursors == []  # fresh: the feed starts every shard at 0
