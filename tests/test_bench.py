"""bench/: what the benchmarks share (bench/common.py) and the listing `make bench` prints
(bench/__main__.py). The benchmarks themselves are run by hand, not here."""

from __future__ import annotations

import json
import re
import types
from collections import Counter
from pathlib import Path

import pytest

from bench import common
from bench.__main__ import benchmarks

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_table_aligns_runs_and_marks_what_a_run_lacks():
    text = common.table(
        "== title",
        [("loop s", ".1f"), ("vs sync", "s")],
        {"sync": {"loop s": 44.25, "vs sync": "1.00x"}, "one_step_off": {"loop s": 9.0}},
    )
    assert text.splitlines() == [
        "== title",
        "run          loop s vs sync",
        "sync           44.2   1.00x",
        "one_step_off    9.0       -",
    ]


def test_metrics_helpers_skip_missing_and_nan():
    rows = [{"a": 1.0, "b": 2.0}, {"a": float("nan")}, {"a": 3.0}]
    assert common.total(rows, "b") == 2.0
    assert common.mean(rows, "a") == 2.0
    assert common.mean(rows, "missing") != common.mean(rows, "missing")  # NaN
    assert common.median(rows, lambda r: r.get("b", 0.0)) == 0.0
    assert common.csv(" sync, ,async ") == ["sync", "async"]


def test_the_listing_names_every_runnable_bench_with_its_question():
    listed = benchmarks()
    runnable = {
        f"bench.{p.stem}"
        for p in BENCH.glob("*.py")
        if not p.stem.startswith("_") and 'if __name__ == "__main__":' in p.read_text()
    }
    assert set(listed) == runnable and "bench.modes" in listed and "bench.common" not in listed
    assert all(question and question != "(no docstring)" for question in listed.values())


def test_no_bench_patches_sys_path_or_builds_its_own_parser():
    """Benchmarks run as `python -m bench.NAME` from the repository root: nothing to patch; their
    --help comes from common.parser (the module docstring, as written)."""
    offenders = {
        p.name
        for p in BENCH.glob("*.py")
        if re.search(r"sys\.path\.insert|ArgumentParser\(", p.read_text()) and p.name != "common.py"
    }
    assert not offenders, offenders


def test_modes_compares_at_the_shortest_loop_time():
    """bench.modes' report from two runs' rows: async twice as fast; the shortest loop (async's,
    10 s) is the horizon at which both rewards are read."""
    from bench import modes

    def step(wall: float, reward: float) -> dict:
        return {"perf/step_wall_s": wall, "rollout/samples": 4.0, "rollout/reward_mean": reward}

    runs = {"sync": [step(10, 0.5), step(10, 1.0)], "async": [step(5, 0.0), step(5, 0.25)]}
    rates = modes.throughput(runs)
    assert rates["async"]["vs sync"] == "2.00x" and rates["sync"]["vs sync"] == "1.00x"
    assert rates["sync"]["reward@10s"] == 0.5 and rates["sync"]["steps@"] == 1
    assert rates["async"]["reward@10s"] == 0.125 and rates["async"]["steps@"] == 2
    lines = modes.report(runs, "== t").splitlines()
    assert lines[1].split()[:4] == ["mode", "loop", "s", "samples/s"]
    assert lines[2].split()[:4] == ["sync", "20.0", "0.40", "1.00x"]
    assert lines[3].split()[:4] == ["async", "10.0", "0.80", "2.00x"]
    assert modes.per_step(runs)["sync"]["wall"] == 10


def test_moe_benches_print_their_docstring_as_help(capsys):
    """--help of the MoE benches parses without starting anything (engines, trainers, processes)."""
    import pytest

    from bench import moe_alignment, moe_step_time

    for module in (moe_alignment, moe_step_time):
        with pytest.raises(SystemExit) as exit_:
            module.main(["--help"])
        assert exit_.value.code == 0
        assert module.__doc__.splitlines()[0] in capsys.readouterr().out


def test_the_gateway_bench_refuses_a_negative_run_skip_and_knows_the_idle_part(monkeypatch, capsys):
    """bench.gateway's options are checked before anything starts (engines, routers, gateways)."""
    import sys

    from bench import gateway

    for argv, says in (
        (["--parts", "overhead", "--run-skip", "-1"], "--run-skip must be 0 or more; got -1"),
        (["--parts", "idle,bogus"], "--parts: unknown bogus (overhead, growth, paired, load, idle)"),
    ):
        monkeypatch.setattr(sys, "argv", ["bench.gateway", *argv])
        with pytest.raises(SystemExit) as exit_:
            gateway.main()
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err


def test_this_waves_benches_refuse_bad_options_in_one_line(monkeypatch, capsys):
    """bench.harness_episode's --reasoning-chars, bench.session_heap's, bench.template_render's and
    bench.gateway_start's, bench.engine_start's, bench.idle_servers' and bench.body_receive's counts: a usage error naming the option, before anything is built or started."""
    import importlib
    import sys

    for module, argv, says in (
        ("harness_episode", ["--reasoning-chars", "-5"], "--reasoning-chars must be 0 or more; got -5"),
        ("session_heap", ["--sessions", "x"], "--sessions takes counts of 1 or more"),
        ("session_heap", ["--sessions", "0,2"], "--sessions takes counts of 1 or more"),
        ("session_heap", ["--turns", "0"], "--turns must be 1 or more; got 0"),
        ("template_render", ["--turns", "-1"], "--turns must be 1 or more; got -1"),
        ("template_render", ["--rounds", "0"], "--rounds must be 1 or more; got 0"),
        ("gateway_start", ["--rounds", "0"], "--rounds must be 1 or more; got 0"),
        ("engine_start", ["--rounds", "0"], "--rounds must be 1 or more; got 0"),
        ("idle_servers", ["--seconds", "0"], "--seconds must be more than 0; got 0.0"),
        ("body_receive", ["--kb", "500,x"], "--kb takes sizes of 1 or more, comma-separated; got '500,x'"),
        ("body_receive", ["--kb", "0"], "--kb takes sizes of 1 or more"),
        ("body_receive", ["--read-kb", "0"], "--read-kb must be 1 or more; got 0"),
        ("body_receive", ["--rounds", "-1"], "--rounds must be 1 or more; got -1"),
    ):
        bench = importlib.import_module(f"bench.{module}")
        monkeypatch.setattr(sys, "argv", [f"bench.{module}", *argv])
        with pytest.raises(SystemExit) as exit_:
            bench.main()
        assert exit_.value.code == 2, module
        assert says in capsys.readouterr().err, (module, argv)


def test_gpu_check_starts_its_trainer_ranks_as_the_module_from_the_repository_root(tmp_path):
    """Its ranks once ran as a script (`python bench/gpu_check.py`), where `from bench import
    common` fails: every trainer check of `make gpu-check` failed before doing anything."""
    import subprocess

    from bench import gpu_check

    ranks = subprocess.run(
        [*gpu_check.WORKER_ARGV, "--help"], cwd=common.ROOT, capture_output=True, text=True, timeout=120
    )
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    assert gpu_check.__doc__.splitlines()[0] in ranks.stdout


def _opd_run(accuracies: list[float], generated: float, per_step: int = 8, lr: float | None = None):
    """An `opd_vs_grpo.Arm` of synthetic rows: an evaluation every step, `generated` samples made and
    8 trained per step, 2 s per step (at `lr`: the trainer's train/lr)."""
    from bench.opd_vs_grpo import Arm

    rows = [{"train/step": 0, "eval/accuracy": accuracies[0]}]
    for step, acc in enumerate(accuracies[1:], start=1):
        rows.append({"train/step": step, "perf/step_wall_s": 2.0, "rollout/samples_generated": generated,
                     "rollout/samples": 8.0, "eval/accuracy": acc, **({"train/lr": lr} if lr else {})})  # fmt: skip
    return Arm(rows, wall=10.0, per_step=per_step)


def test_opd_vs_grpo_counts_generated_samples_to_target_and_gives_the_ratio_with_its_spread(tmp_path):
    from bench.opd_vs_grpo import lr_label, per_arm, plot, ratio_line

    grpo = [_opd_run([0.3, 0.35, 0.4, 0.5], 24.0), _opd_run([0.3, 0.5, 0.5, 0.5], 16.0)]
    opd = [_opd_run([0.3, 0.5, 0.6, 0.6], 8.0)]
    assert grpo[0].reached(0.5) == 3 and grpo[0].samples_to(3) == 72.0 and grpo[0].samples_to(3, True) == 24.0
    assert grpo[0].seconds_to(3) == 6.0
    # OPD: 8 samples to target; GRPO 72 and 16 (mean 44): 8 / 44, pairs 8/72 .. 8/16
    line = ratio_line("opd-full", opd, "grpo-ds", grpo, 0.5)
    assert "= 0.182 (pairs 0.111-0.500)" in line and "(1/1 seeds vs 2/2" in line
    missed = ratio_line("opd-full", opd, "grpo-ds", [_opd_run([0.3, 0.3], 8.0)], 0.5)
    assert "grpo-ds not reached (1/1 seeds vs 0/1); samples: ratio <= 1.000 counting 1 missed" in missed
    old = _opd_run([0.3, 0.5], 8.0)  # rows of a run before dynamic sampling's counts: steps x samples
    del old.rows[1]["rollout/samples_generated"]
    assert old.samples_to(1) == 8.0
    assert per_arm("grpo-ds=3,opd-full=2", ["grpo-ds"], "--seeds") == {"grpo-ds": 3, "opd-full": 2}
    assert per_arm("3e-4", ["grpo", "opd"], "--lr", float) == {"grpo": 3e-4, "opd": 3e-4}
    png = tmp_path / "fig.png"
    plot(png, {"grpo-ds": grpo, "opd-full": opd}, teacher_acc=0.95, target=0.5, title="t")
    lr1, lr3 = _opd_run([0.3, 0.5], 8.0, lr=1e-4), _opd_run([0.3, 0.5], 8.0, lr=3e-4)
    assert lr_label([lr3, _opd_run([0.3], 8.0)]) == "lr 0.0003"  # a run of no step has no lr
    assert lr_label([lr1, lr3]) == "lr 0.0001/0.0003"
    assert lr_label([_opd_run([0.3, 0.5], 8.0)]) == "lr: the config's"  # rows without train/lr
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_opd_vs_grpo_counts_a_missed_seed_at_its_budget_for_a_bound_on_the_ratio():
    from bench.opd_vs_grpo import ratio_line

    # the baseline: seed 0 at the target at step 2 (32 samples, 4 s), seed 1 never within 3 steps
    # (its budget: 48 samples, 6 s); the arm reaches it at step 1 (8 samples, 2 s)
    base = [_opd_run([0.3, 0.4, 0.5], 16.0), _opd_run([0.3, 0.4, 0.4, 0.4], 16.0)]
    arm = [_opd_run([0.3, 0.5], 8.0)]
    line = ratio_line("opd-full", arm, "grpo-ds", base, 0.5)
    assert "samples 8 / 32 = 0.250" in line and "seconds 2 / 4 = 0.500" in line  # the reached seed alone
    assert "seeds that missed it are left out" in line
    # 8 / mean(32, 48) and 2 / mean(4, 6): the missed seed would have cost more than its budget
    assert "samples: ratio <= 0.200 counting 1 missed seed(s) at their budget" in line
    assert "seconds: ratio <= 0.400 counting 1 missed seed(s) at their budget" in line
    # the arm's own missed seed makes it a lower bound; both sides missing: no bound either way
    slow = [_opd_run([0.3, 0.5], 8.0), _opd_run([0.3, 0.4, 0.4, 0.4, 0.4], 8.0)]  # 8 and 32 samples
    low = ratio_line("opd", slow, "grpo-ds", base[:1], 0.5)
    assert "samples: ratio >= 0.625 counting 1 missed seed(s)" in low  # mean(8, 32) / 32
    both = ratio_line("opd", slow, "grpo-ds", base, 0.5)
    assert "samples: ratio ~ 0.500 counting 2 missed seed(s)" in both and "(no bound: both sides" in both
    assert "missed" not in ratio_line("opd", arm, "grpo-ds", base[:1], 0.5)  # every seed reached it


def test_opd_vs_grpo_reports_and_draws_earlier_runs_without_running_any(tmp_path, capsys):
    from bench.opd_vs_grpo import main

    runs = {"grpo-ds": [{"rows": _opd_run([0.3, 0.4, 0.5], 16.0, lr=3e-4).rows, "wall": 30.0}] * 2,
            "opd-full": [{"rows": _opd_run([0.3, 0.5, 0.6], 8.0, lr=1e-3).rows, "wall": 20.0}]}  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    png = tmp_path / "fig.png"
    argv = ["--arms", "", "--task", "worked_steps", "--teacher-acc", "0.9", "--target-acc", "0.5",
            "--load", str(tmp_path / "runs.json"), "--png", str(png)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "grpo-ds   2 seed(s), lr 0.0003;" in out and "0:0.300±0.000 1:0.400±0.000 2:0.500±0.000" in out
    assert "opd-full  1 seed(s), lr 0.001;" in out  # each arm's own, read back from its rows
    assert "opd-full  samples 8 / 32±0 = 0.250 (pairs 0.250-0.250)" in out  # 1 step of 8 vs 2 of 16
    # perf/score_s times the old pass (when apart), the reference pass and the advantages
    assert "old+ref+adv" in out and "old pass" not in out
    assert png.stat().st_size > 0


def test_opd_vs_grpo_sweep_only_keeps_the_best_lr_and_reports_no_runs(monkeypatch, capsys):
    import bench.opd_vs_grpo as bench

    made = []

    def fake_run(name, out, overrides, per_step=0):  # the last held-out accuracy grows with the lr
        made.append(name)
        lr = float(next(o for o in overrides if o.startswith("trainer.megatron_optimizer.lr=")).split("=")[1])
        return _opd_run([0.3, 0.3 + lr * 100], 8.0)

    monkeypatch.setattr(bench, "run", fake_run)
    argv = ["--arms", "grpo-ds", "--seeds", "grpo-ds=0", "--sweep", "1e-4,3e-4", "--sweep-steps", "1",
            "--task", "worked_steps", "--teacher-acc", "0.9", "--target-acc", "0.5"]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert made == ["grpo-ds-lr0.0001", "grpo-ds-lr0.0003"]  # the sweep's runs only, no seed run
    assert "grpo-ds lr 0.0003: 0:0.300 1:0.330; 2.00 s per step, 8 samples generated" in out
    assert "-> lr 0.0003" in out and "seed(s)" not in out


def test_opd_vs_grpo_stops_a_run_at_its_first_evaluation_at_the_target(monkeypatch, capsys, tmp_path):
    import bench.opd_vs_grpo as bench

    rows = _opd_run([0.3, 0.45, 0.5, 0.6], 16.0).rows
    del rows[1]["eval/accuracy"]  # a step without an evaluation: never a stop, whatever else it holds

    def fake_train(out, name, overrides, hook=None):  # the loop's "step" phase after each step's row
        state = types.SimpleNamespace(rows=[rows[0]])
        for step, row in enumerate(rows[1:]):
            state.rows = [*state.rows, row]
            for phase in ("batch", "sync", "step"):
                if hook is not None:
                    hook(phase, step, types.SimpleNamespace(state=state))
        return types.SimpleNamespace(state=state)

    monkeypatch.setattr(bench, "train_demo", fake_train)
    stopped = bench.run("opd-full-s0", tmp_path, [], 8, stop=0.5)
    assert stopped.curve == [(0, 0.3), (2, 0.5)] and stopped.samples_to(2) == 32.0  # 2 steps, not 3
    assert bench.run("opd-full-s0", tmp_path, [], 8).curve[-1] == (3, 0.6)  # no target: to the end
    assert bench.stop_at(None) is None

    # main: --stop-at-target hands the target to every seed's run; a seed that stopped early leaves
    # the later evaluations to the others, counted in brackets; the header's standard error is a
    # whole evaluation's at the target
    given = []

    def fake_run(name, out, overrides, per_step=0, stop=None):
        given.append(stop)
        return _opd_run([0.3, 0.5] if name.endswith("s0") else [0.3, 0.4, 0.5], 8.0)

    monkeypatch.setattr(bench, "run", fake_run)
    argv = ["--arms", "opd-full", "--seeds", "opd-full=2", "--task", "worked_steps", "--teacher-acc", "0.9",
            "--target-acc", "0.5", "--stop-at-target"]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert given == [0.5, 0.5] and "0:0.300±0.000 1:0.450±0.050 2:0.500(1)" in out
    assert "(one evaluation at the target: standard error 0.035)" in out  # (0.5 * 0.5 / 200) ** 0.5
    given.clear()
    assert bench.main(argv[:-1]) == 0 and given == [None, None]


def test_the_chaos_schedule_is_drawn_from_the_seed_alone():
    """bench/chaos.py: the same seed, the same faults at the same moments; another seed, others;
    every kind about as often, a sandbox only during generation, steps within the run."""
    from bench import chaos

    first, again = chaos.schedule(7, 50, 40), chaos.schedule(7, 50, 40)
    assert first == again and first != chaos.schedule(8, 50, 40)
    counts = {kind: sum(k.kind == kind for k in first) for kind in chaos.KINDS}
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert all(k.moment == "generation" for k in first if k.kind == "sandbox")
    assert all(1 <= k.step <= 38 and k.moment in chaos.MOMENTS for k in first)


def test_the_chaos_soak_counts_every_failed_episode_from_the_spool_by_what_became_of_it():
    """bench/chaos.py: the metrics rows count the failed episodes of the groups a step's batch took;
    the spool has every one. Each failed session once (a session of two samples too), under its
    `failure/<reason>` (``error`` without one), split by its samples' reason not to train."""
    from bench import chaos

    def sample(sid: str, session: str, status: str = "failed", **failure: float) -> dict:
        metrics = {"error": 1.0, **{f"failure/{k}": v for k, v in failure.items()}}
        return {"sample_id": sid, "session_id": session, "status": status, "metrics": metrics}

    samples = [
        sample("a", "s1", sandbox_error=1.0),
        sample("b", "s1", sandbox_error=1.0),  # the same session's second sample: once
        sample("c", "s2", sandbox_error=1.0),
        sample("d", "s3"),
        sample("e", "s4", status="completed"),
        sample("f", "s5", sandbox_error=0.0),
    ]
    reasons = {"a": "failed", "b": "failed", "c": "runner_died", "d": "failed", "f": "trainer_restart"}
    assert chaos.failed_episodes(samples, reasons) == {
        "sandbox_error": Counter({"failed": 1, "runner_died": 1}),
        "error": Counter({"failed": 1, "trainer_restart": 1}),
    }


class _FlakyStart:
    """Test double for a run's start: raises each of `errors` in turn (None: the run trains a step,
    calling `hook` when one is given, then raises nothing), then returns "ran"."""

    def __init__(self, *errors: Exception | None):
        self.errors, self.calls = list(errors), 0

    def __call__(self, cfg=None, hook=None):
        self.calls += 1
        error = self.errors.pop(0) if self.errors else None
        if error is not None and "after a step" in str(error) and hook is not None:
            hook("step", 0, None)  # the run got past its start before it failed
        if error is not None:
            raise error
        return "ran"


_NODE_TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the raylet failed "
    "to startup or the GCS has become overloaded."
)


def test_a_bench_starts_a_run_again_only_when_ray_itself_did_not_start(capsys):
    start = _FlakyStart(Exception(_NODE_TIMEOUT))
    assert common.retry_ray_start(start, "run grpo-s0") == "ran" and start.calls == 2
    note = capsys.readouterr().err.strip()
    assert (
        note == f"run grpo-s0: Ray did not start (Exception: {_NODE_TIMEOUT}); starting it again (try 2 of 3)"
    )
    start = _FlakyStart(*[Exception(_NODE_TIMEOUT)] * 3)  # three times: the last failure is raised
    with pytest.raises(Exception, match="timed out during startup"):
        common.retry_ray_start(start, "run")
    assert start.calls == 3 and capsys.readouterr().err.count("starting it again") == 2
    start = _FlakyStart(RuntimeError("the trainer died at step 3"))  # a failure inside training: once
    with pytest.raises(RuntimeError, match="trainer died"):
        common.retry_ray_start(start, "run")
    assert start.calls == 1
    start = _FlakyStart(Exception(_NODE_TIMEOUT))  # the same words once the run began: not its start
    with pytest.raises(Exception, match="timed out"):
        common.retry_ray_start(start, "run", began=lambda: True)
    assert start.calls == 1 and "again" not in capsys.readouterr().err


def test_a_bench_run_that_stepped_is_never_started_again(monkeypatch, tmp_path):
    """train_config's run: retried when Ray's start failed before any step, not after one."""
    calls = []
    start = _FlakyStart(Exception(_NODE_TIMEOUT))
    monkeypatch.setattr(common, "train", start)
    assert common.train_demo(tmp_path, "t", [], hook=lambda *a: calls.append(a[0])) == "ran"
    assert start.calls == 2
    start = _FlakyStart(Exception(f"{_NODE_TIMEOUT} (after a step)"))
    monkeypatch.setattr(common, "train", start)
    with pytest.raises(Exception, match="after a step"):
        common.train_demo(tmp_path, "t", [], hook=lambda *a: calls.append(a[0]))
    assert start.calls == 1 and calls == ["step"]  # the bench's own hook still saw the phase
