"""`palaestra train` end to end on Ray: 2 embedded engines + router + gateway + environment + trainer.

CI-sized runs of the `tiny` preset (a few steps, tiny batches, short answers), one Ray for the
module, everything on 127.0.0.1:

* sync, then resume from its checkpoint: samples flow, every engine's `/get_weight_version` goes
  0 -> 2 -> 3, metrics are finite, the report files exist; the resumed run starts at step 2,
  weight version 2 and the saved cursor, and trains the tasks an uninterrupted run would have;
  once with one gateway and once with `gateway.shards=2` (two shards, a front, a cursor per shard);
* one-step-off: every batch is exactly one weight version old (the first: zero);
* async (the two-turn environment's gate holds one task's sessions between their turns across the
  first weight sync): no trained sample is older than `run.max_staleness`, and sessions in flight
  across a sync keep their first turn's tokens and show both versions;
* faults: a killed engine with `run.max_restarts=0` stops the run with its name, exit code and log
  (tests/orchestrator/test_faults.py: with restarts left, every kind of box is survived); a stuck step times out.

What decides what trains (`select_batch`, `sample_lag`, the sample feed, task order) is tested
without Ray in tests/orchestrator/test_batching.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time

import pytest

from palaestra.gateway.shards import shard_of
from tests.support.runs import TWO_TURN, make_config

pytestmark = pytest.mark.ray  # every test runs on the module's Ray


# ----------------------------------------------------------------------------------------------
# End to end on Ray
# ----------------------------------------------------------------------------------------------
def assert_finite(rows: list[dict]) -> None:
    keys = ["train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "mismatch/logprob_abs_diff"]
    for row in rows:
        if "train/loss" in row:
            assert all(math.isfinite(row[k]) for k in keys), row


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("shards", [1, 2])  # 2: two gateway shards behind a front (gateway/shards.py)
def test_sync_run_then_resume_continues_step_version_cursor_and_data_order(ray_local, tmp_path, shards):
    from palaestra.sdk import load_environment
    from palaestra.sdk.runner import take_tasks
    from palaestra.train import train

    out = tmp_path / "sync"
    sharded = (f"gateway.shards={shards}",)
    killed: list[int] = []
    hook = functools.partial(_kill_shard_1_at_the_first_checkpoint, killed) if shards > 1 else None
    first = train(make_config(out, "sync", "logging.tensorboard_dir=tb", *sharded), hook=hook)
    assert first.engine_versions_start == ["0", "0"] and first.engine_versions_end == ["2", "2"]
    assert [len(r.sample_ids) for r in first.trained] == [4, 4]  # 2 tasks x 2 samples per step
    assert all(lag == 0 for r in first.trained for lag in r.lags)
    assert_finite(first.state.rows)
    assert first.eval_before is not None and first.eval_after is not None
    for name in ("reward_curve.png", "viewer.html", "config.yaml"):
        assert (out / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "rollout/reward_mean" in rows[1]
    assert rows[0]["eval/accuracy"] == first.eval_before["accuracy"]  # the evaluation before training
    # on the last step's row: the accuracy after it, and each task kind's (the tasks mix two kinds)
    kinds = {f"eval/{k}": v for k, v in first.eval_after.items() if k.startswith("accuracy/")}
    assert set(kinds) == {"eval/accuracy/arithmetic", "eval/accuracy/word_problem"}
    assert "rollout/reward_mean" in rows[2]
    assert {k: rows[2][k] for k in ("eval/accuracy", *kinds)} == {
        "eval/accuracy": first.eval_after["accuracy"],
        **kinds,
    }
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"

    resumed = train(make_config(out, "sync", "run.steps=3", "run.resume=true", *sharded))
    assert (resumed.start_step, resumed.start_weight_version) == (2, 2)
    assert resumed.start_cursors == first.state.cursors and len(first.state.cursors) == shards
    assert all(c > 0 for c in first.state.cursors)  # every shard spooled samples of the run
    if shards > 1:
        assert sorted(p.name for p in (out / "spool").iterdir() if p.is_dir()) == ["shard-0", "shard-1"]
    assert resumed.engine_versions_start == ["2", "2"] and resumed.engine_versions_end == ["3", "3"]
    assert len(resumed.trained) == 1 and resumed.trained[0].trainer_version == 2
    expected = [t.task_id for t in take_tasks(load_environment("math", difficulty=1), 6, seed=0)]
    trained = [tid for run in (first, resumed) for r in run.trained for tid in r.task_ids]
    assert trained == expected  # the same data order as an uninterrupted run
    assert resumed.eval_before is None  # evaluated before step 1 already: the curve keeps that point
    assert resumed.state.rows[0]["eval/accuracy"] == first.eval_before["accuracy"]
    if shards > 1:
        _check_the_killed_shard(out, first, resumed, killed)


def _kill_shard_1_at_the_first_checkpoint(killed: list[int], phase: str, step: int, run) -> None:
    """The run's hook: SIGKILLs gateway shard 1's process (its own pid) once step 1's checkpoint is
    saved and before the driver acknowledges the spools, and returns once it is gone: the driver's
    acknowledgement then meets the dead shard (the front answers 503 for it)."""
    import ray

    if (phase, step) != ("checkpoint_saved", 0) or killed:
        return
    pid = ray.get(run.cluster.gateway_shards[1].actor.pid.remote(), timeout=60)
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)
    for _ in range(600):  # its parent (the shard's host actor) reaps it at once; a zombie is gone too
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"gateway shard 1 (pid {pid}) still running 30 s after SIGKILL")


def _check_the_killed_shard(out, first, resumed, killed: list[int]) -> None:
    """Shard 1 died once, was restarted on its port and spool, and nothing was lost or trained twice."""
    assert len(killed) == 1, "the hook never killed shard 1"
    (fault,) = first.faults
    assert fault["component"] == "gateway-shard-1"
    assert fault["phase"] == "acknowledging the checkpoint to the gateway's spool"
    assert "restarted on the same port" in fault["action"] and "lost" not in fault["action"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("faults/gateway_shard", 0) for r in rows) == 1
    assert not resumed.faults
    trained = [sid for run in (first, resumed) for r in run.trained for sid in r.sample_ids]
    assert len(trained) == len(set(trained)), "a sample trained twice"
    not_trained = {**(first.not_trained or {}), **(resumed.not_trained or {})}
    spooled = [
        json.loads(line)["sample"]
        for segment in sorted((out / "spool").glob("shard-*/samples-*.jsonl"))
        for line in segment.read_text().splitlines()
        if line
    ]
    made = {s["sample_id"] for s in spooled if not s["group_id"].rsplit("/", 1)[-1].startswith("eval-")}
    assert set(trained) <= made and made <= set(trained) | set(not_trained), "a sample lost"
    assert {s["sample_id"] for s in spooled if shard_of(s["session_id"], 2) == 1} & set(trained)


MIX_ARGS = (
    "env.args={environments: {"
    "math: {args: {difficulty: 1, max_tokens: 12}}, "
    "reasoning-gym: {args: {datasets: [chain_sum], max_tokens: 12}}, "
    "textarena: {args: {games: [GuessTheNumber-v0], max_turns: 2, max_tokens: 8}}}}"
)


@pytest.mark.slow
@pytest.mark.engine
def test_a_mixed_run_trains_math_reasoning_gym_and_textarena_with_metrics_per_family(ray_local, tmp_path):
    """One step on the `mix` family: its six tasks (seed 1) and three held-out ones hold all three
    families, and the step's metrics and both evaluations report each family by name."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is an extra: make install installs it")
    pytest.importorskip("textarena", reason="textarena is an extra: make install installs it")
    from palaestra.train import train

    families = {"math", "reasoning-gym", "textarena"}
    out = tmp_path / "mix"
    extra = ["engines.count=1", "env.name=mix", MIX_ARGS, "env.tasks_per_step=6", "env.eval_tasks=3"]
    result = train(make_config(out, "sync", *extra, "run.steps=1", "run.seed=1", "run.checkpoint_every=0"))
    (record,) = result.trained
    # 6 tasks x 2 sessions; a game's session may fork into more than one sample (its own group's)
    assert len(set(record.task_ids)) == 6 and len(record.sample_ids) >= 12
    assert {tid.split("/")[0] for tid in record.task_ids} == families
    step = next(r for r in result.state.rows if "rollout/reward_mean" in r)
    assert step["rollout/groups"] == 6
    for family in families:
        assert math.isfinite(step[f"rollout/reward_mean/{family}"]), family
    assert sum(step[f"rollout/groups/{f}"] for f in families) == 6
    assert_finite(result.state.rows)
    for evaluation in (result.eval_before, result.eval_after):
        assert {k for k in evaluation if k.startswith("accuracy/")} == {f"accuracy/{f}" for f in families}


@pytest.mark.slow
@pytest.mark.engine
def test_two_data_parallel_trainer_ranks_learn_like_one(ray_local, tmp_path):
    """trainer.dp_size: 2 starts two trainer rank actors that split each batch; seeded runs
    generate the same rollouts, so DP = 2 must train exactly as DP = 1 (fp32 tolerance)."""
    from palaestra.train import train

    sft = "trainer.advantage_estimator=sft"  # every sample pulls: gradients whatever the rewards
    one = train(make_config(tmp_path / "dp1", "sync", sft))
    two = train(make_config(tmp_path / "dp2", "sync", sft, "trainer.dp_size=2"))
    assert two.engine_versions_end == ["2", "2"]
    assert_finite(two.state.rows)
    trained = [(r.step, sorted(r.task_ids)) for r in one.trained]
    assert [(r.step, sorted(r.task_ids)) for r in two.trained] == trained
    rows1 = [r for r in one.state.rows if "train/loss" in r]
    rows2 = [r for r in two.state.rows if "train/loss" in r]
    assert len(rows1) == len(rows2) == 2
    for a, b in zip(rows1, rows2, strict=True):
        print(f"step {a['train/step']:.0f}: loss DP=1 {a['train/loss']:.6g} DP=2 {b['train/loss']:.6g}, "
              f"grad norm {a['train/grad_norm']:.6g} / {b['train/grad_norm']:.6g}, "
              f"reward {a['rollout/reward_mean']:.3f} / {b['rollout/reward_mean']:.3f}")  # fmt: skip
        assert b["rollout/reward_mean"] == a["rollout/reward_mean"]  # the same rollouts
        for key in ("train/loss", "train/nll", "train/entropy", "train/loss_tokens", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert rows1[0]["train/grad_norm"] > 0  # it did learn: step 2 rolled out with updated weights


@pytest.mark.slow
@pytest.mark.engine
def test_one_step_off_with_opd_trains_each_batch_one_version_old(ray_local, tmp_path):
    from palaestra.train import train

    out = tmp_path / "osp"
    opd = ["model.teacher=tiny", "trainer.opd.kl_coef=0.5", "trainer.opd.teacher_mode=megatron"]
    result = train(make_config(out, "one_step_off", "run.steps=3", "trainer.keep_old_actor=true", *opd))
    assert [sorted(set(r.lags)) for r in result.trained] == [[0], [1], [1]]
    assert result.engine_versions_end == ["3", "3"]  # read before the teacher's weights went on
    assert_finite(result.state.rows)
    assert all(math.isfinite(r["opd/reverse_kl"]) for r in result.state.rows if "train/loss" in r)
    # env.eval_teacher: the teacher scored on the same held-out tasks, shown in the summary
    assert result.teacher_accuracy is not None and 0.0 <= result.teacher_accuracy <= 1.0
    assert f"teacher {result.teacher_accuracy:.3f}" in result.summary


@pytest.mark.slow
@pytest.mark.engine
def test_async_respects_the_staleness_bound_and_keeps_partial_rollouts(ray_local, tmp_path):
    """Task 2's sessions answer their first turn before the first weight sync and their second
    after it, however fast the steps run: the environment's gate holds them between their turns
    (`TwoTurnEnv(gate=...)`) from step 1's batch (nothing synced yet: the run's hook waits there
    until they arrived) until step 1 is over (version 1 on the engines). One group runs at a time
    (env.concurrency = samples_per_task), so the held group is the next to finish: step 2 trains it."""
    import time

    from palaestra.train import train

    gate = tmp_path / "gate"
    gate.mkdir()

    def hold_task_2_across_the_first_sync(phase, step, run):
        if (phase, step) == ("batch", 0):  # step 1's batch is read; nothing is synced yet
            deadline = time.monotonic() + 300
            while len(list(gate.glob("arrived-2-*"))) < 2:
                assert time.monotonic() < deadline, "task 2's sessions never reached the gate"
                time.sleep(0.05)
        elif (phase, step) == ("step", 0):  # weight version 1 is on the engines
            (gate / "open-2").touch()

    cfg = make_config(
        tmp_path / "async",
        "async",
        f"env.name={TWO_TURN}",
        f"env.args={{pause_s: 0.2, gate: '{gate}', gated: [2]}}",
        "env.eval_tasks=0",
        "env.concurrency=2",
        "run.steps=3",
        "run.max_staleness=2",
        "trainer.tis.enabled=true",
        f"gateway.routing_trace={tmp_path / 'routing.jsonl'}",
    )
    try:
        result = train(cfg, hook=hold_task_2_across_the_first_sync)
    finally:
        (gate / "open-2").touch()
    lags = [lag for r in result.trained for lag in r.lags]
    assert lags and max(lags) <= 2
    assert result.engine_versions_end == ["3", "3"]
    # Sessions that were in flight across a weight sync: turn 1 at one version, turn 2 at the next.
    step2 = result.trained[1]
    assert "count-0-2" in step2.task_ids, [r.task_ids for r in result.trained]
    assert sum(v == ["0", "1"] for v in step2.versions) >= 2, [r.versions for r in result.trained]
    assert_finite(result.state.rows)
    # placement is on by default behind the router: every engine call was placed on a worker (the
    # record's `worker` is None for a call that carried the routing key only)
    calls = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert calls and all(c["worker"] in (0, 1) for c in calls), calls[:3]


@pytest.mark.slow
@pytest.mark.engine
def test_a_dead_engine_beyond_max_restarts_stops_the_run_with_its_name_and_log(ray_local, tmp_path):
    import ray

    from palaestra.orchestrator.errors import RunFailed
    from palaestra.train import train

    def kill_engine_1(phase, step, run):  # the run's hook: once step 1 is over
        if (phase, step) == ("step", 0):
            os.kill(ray.get(run.cluster.engines[1].actor.pid.remote()), signal.SIGKILL)

    cfg = make_config(
        tmp_path / "dead",
        "sync",
        "run.steps=3",
        "env.eval_tasks=0",
        "run.checkpoint_every=0",
        "run.max_restarts=0",
    )
    with pytest.raises(RunFailed, match=r"engine-1 \(http://127\.0\.0\.1:\d+\) exited with code -9") as err:
        train(cfg, hook=kill_engine_1)
    assert "engine-1.log" in str(err.value)


@pytest.mark.slow  # only for the module's Ray start-up (~4 s)
def test_a_stuck_step_times_out_with_the_phase_it_was_in(ray_local):
    import time

    import ray

    from palaestra.orchestrator.errors import StepTimeout
    from palaestra.orchestrator.waiting import Waiter

    class Alive:  # the servers' liveness check passes: only the deadline can end the wait
        def check_alive(self, phase: str) -> None:
            pass

    @ray.remote(num_cpus=0)
    def stuck() -> None:
        time.sleep(600)

    waiter = Waiter(Alive(), timeout_s=1.0, poll_s=0.2)
    waiter.start_step(4)
    ref = stuck.remote()
    started = time.monotonic()
    with pytest.raises(StepTimeout, match=r"step 5 exceeded run.step_timeout_s=1 s during generation"):
        waiter.get([ref], "generation")
    assert time.monotonic() - started < 5
    ray.cancel(ref, force=True)


@pytest.mark.slow
@pytest.mark.engine
def test_a_lora_run_serves_and_syncs_only_the_adapter_and_exports_it(ray_local, tmp_path):
    """trainer.lora.rank: the engines start with --enable-lora and serve the start adapter, the
    gateway samples every token through it (the trainer's recomputed logprobs equal the engine's),
    each sync sends the adapter's bytes only, and the run's checkpoint exports as PEFT's layout."""
    from palaestra.cli import main
    from palaestra.models import resolve_model
    from palaestra.train import train
    from palaestra.trainer.convert import HFArchitecture
    from palaestra.trainer.lora import projection_shapes
    from palaestra.weights_format import read_adapter

    out = tmp_path / "lora"
    # a high lr: after one step the adapter is far from the base, so a gateway that sampled
    # without it would show in the mismatch of step 2
    lora = [
        "trainer.lora={rank: 8, alpha: 16}",
        "trainer.kl.coef=0.05",
        "trainer.megatron_optimizer={lr: 1.0e-2}",
        "trainer.advantage_estimator=sft",  # every sample pulls, whatever the rewards
    ]
    result = train(make_config(out, "sync", *lora))
    assert result.engine_versions_start == ["0", "0"] and result.engine_versions_end == ["2", "2"]
    assert_finite(result.state.rows)
    from transformers import AutoConfig

    arch = HFArchitecture.from_hf_config(AutoConfig.from_pretrained(resolve_model("tiny")))
    adapter_bytes = arch.num_layers * sum(8 * (o + i) * 4 for o, i in projection_shapes(arch).values())
    rows = [r for r in result.state.rows if "train/loss" in r]
    assert len(rows) == 2
    for r in rows:
        sent = r["perf/sync_bytes"]
        print(f"step {r['train/step']:.0f}: sync {sent / 1e3:.0f} kB in {r['perf/sync_s'] * 1e3:.0f} ms, "
              f"mismatch max |Δlogprob| {r['mismatch/logprob_abs_diff']:.2e}, kl {r['train/kl']:.2e}")  # fmt: skip
        assert sent == adapter_bytes  # the adapter, not the model
        assert r["mismatch/logprob_abs_diff"] <= 1e-6  # sampled through the adapter the trainer holds
    assert rows[0]["train/kl"] == 0.0  # the reference is the frozen base: B = 0 at the start
    assert rows[1]["train/kl"] > 1e3 * rows[1]["mismatch/logprob_abs_diff"]  # step 2 sampled through v1
    ckpt = out / "checkpoints" / "step-000002" / "trainer"  # the trainer's part of the run's checkpoint
    assert (ckpt / "adapter.pt").is_file() and not (ckpt / "model.pt").exists()
    assert main(["export", str(out), "--out", str(tmp_path / "peft")]) == 0
    assert read_adapter(tmp_path / "peft").rank == 8


@pytest.mark.slow
@pytest.mark.engine
def test_a_moe_run_with_expert_parallelism_trains_on_the_engines_routing(ray_local, tmp_path):
    """`tiny-moe` with routing_replay r3 and expert_model_parallel_size 2 (two trainer ranks): the
    engines start with --enable-return-routed-experts, the gateway posts each call to its session's
    worker (the router would drop the field) and stores the routing in every sample, and the trainer
    replays it: no sample is dropped for its routing, the trainer's logprobs match the engines', and
    a sync moves the expert weights (step 2 sampled on version 1 within the same bound)."""
    from palaestra.train import train

    moe = [
        "model.student=tiny-moe",
        "trainer.dp_size=2",
        "trainer.megatron={expert_model_parallel_size: 2}",
        "trainer.routing_replay=r3",
        "trainer.advantage_estimator=sft",  # every sample pulls: the weights move whatever the rewards
        "trainer.megatron_optimizer={lr: 1.0e-2}",
    ]
    result = train(make_config(tmp_path / "moe", "sync", *moe))
    assert result.engine_versions_end == ["2", "2"]
    assert [len(r.sample_ids) for r in result.trained] == [4, 4]
    rows = [r for r in result.state.rows if "train/loss" in r]
    assert len(rows) == 2
    for r in rows:
        print(f"step {r['train/step']:.0f}: mismatch max |Δlogprob| {r['mismatch/logprob_abs_diff']:.2e}, "
              f"expert load imbalance {r['train/moe_load_imbalance']:.2f}")  # fmt: skip
        assert r["train/routing_replay_dropped"] == 0.0
        assert r["mismatch/logprob_abs_diff"] <= 1e-5
        assert r["train/moe_load_imbalance"] >= 1.0
    assert rows[1]["train/grad_norm"] > 0
