"""bench/two_domains.py's table over seeds (`--load`): no training here, hand-made curves."""

from __future__ import annotations

import json

import pytest

from bench import two_domains


def _run(panel: tuple[float, float], sums: tuple[float, float], steps: tuple[float, float]) -> dict:
    def rows(last: tuple[float, float]) -> list[dict]:
        start = {"train/step": 0, "eval/accuracy/arithmetic": 0.5, "eval/accuracy/worked_steps": 0.25}
        end = {"train/step": 60, "eval/accuracy/arithmetic": last[0], "eval/accuracy/worked_steps": last[1]}
        return [start, end]

    return {"arms": {"panel": rows(panel), "sums-teacher": rows(sums), "steps-teacher": rows(steps)}}


def test_the_seed_table_pairs_the_panel_with_each_specialist_and_each_single_teacher(tmp_path, capsys):
    runs = [
        _run(panel=(0.6, 0.4), sums=(0.7, 0.1), steps=(0.3, 0.5)),
        _run(panel=(0.8, 0.4), sums=(0.7, 0.2), steps=(0.4, 0.3)),
    ]
    files = []
    for i, run in enumerate(runs):
        files.append(tmp_path / f"s{i}.json")
        files[-1].write_text(json.dumps(run))
    assert two_domains.main(["--load", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "over 2 runs (s0.json, s1.json)" in out
    # the panel's arithmetic: 0.6 and 0.8 -> mean 0.7, se stdev/sqrt(2) = 0.1414/1.414 = 0.1
    assert "arithmetic 0.600 / 0.800 (0.700 ± 0.100)" in out
    # against the arithmetic specialist on arithmetic: -0.1 and +0.1 -> 0.000 ± 0.100
    assert "arithmetic, against its specialist sums-teacher: +0.000 ± 0.100" in out
    # worked_steps against steps-teacher: -0.1, +0.1 -> 0.000 ± 0.100
    assert "worked_steps, against its specialist steps-teacher: +0.000 ± 0.100" in out
    # two-kind means: panel 0.5, 0.6; sums 0.4, 0.45 -> +0.1, +0.15 -> 0.125 ± 0.025
    assert "two-kind mean, against sums-teacher alone: +0.125 ± 0.025" in out
    # steps 0.4, 0.35 -> +0.1, +0.25 -> 0.175 ± 0.075
    assert "two-kind mean, against steps-teacher alone: +0.175 ± 0.075" in out


def test_a_missing_file_is_a_one_line_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        two_domains.main(["--load", str(tmp_path / "absent.json")])
    assert e.value.code == 2
    assert "--load:" in capsys.readouterr().err
