"""The run's report (`palaestra.orchestrator.report`: the reward-curve PNG) and the static trajectory
viewer (`palaestra.orchestrator.viewer`), on real `Sample`s and the `tiny` preset's tokenizer."""

from __future__ import annotations

import json
import re
import struct

import pytest

from palaestra.orchestrator.report import accuracy_points, plot_reward_curve, reward_band
from palaestra.orchestrator.viewer import token_texts, write_trajectory_viewer
from palaestra.sample import Sample, sample_id_for

EVIL = "<script>alert('pwned')</script>"


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _samples(tok) -> list[Sample]:
    """Four samples: plain, a tool turn (masked env tokens), a fork with an evil token, no teacher."""
    samples = []
    for i in range(4):
        prompt = _encode(tok, f"<|im_start|>user\nWhat is {i}*7?<|im_end|>\n<|im_start|>assistant\n")
        sample = Sample(
            sample_id=sample_id_for(f"sess{i}", 0),
            session_id=f"sess{i}",
            group_id="math/0/r",
            env="math",
            task_id=f"task-{i}",
            tokens=list(prompt),
            prompt_len=len(prompt),
            reward=[1.0, 0.0, 0.5, 0.0][i],
            status="truncated" if i == 3 else "completed",
            fork_index=1 if i == 2 else 0,
            fork_reason="prefix_changed" if i == 2 else None,
        )
        answer = _encode(tok, f"{i} times 7 is {i * 7}. héllo → {EVIL if i == 2 else 'ok'}<|im_end|>")
        sample.append(
            answer, sampled=True, logprobs=[-0.1 * (k % 7) for k in range(len(answer))], weight_version="3"
        )
        if i == 1:
            sample.append(
                _encode(tok, "\n<|im_start|>user\n<tool_response>\n7\n</tool_response>"), sampled=False
            )
            more = _encode(tok, "Done.<|im_end|>")
            sample.append(more, sampled=True, logprobs=[-0.5] * len(more), weight_version="3")
        if i != 3:
            sample.teacher_logprobs = [lp - 0.25 * (k % 3) for k, lp in enumerate(sample.rollout_logprobs)]
            sample.teacher = "teacher-preset"
        samples.append(sample)
    return samples


def _data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert match, "the viewer embeds its data as JSON"
    return json.loads(match.group(1))


def test_token_texts_reassemble_the_text(tok):
    text = "héllo → wörld 日本 <|im_end|>"
    ids = _encode(tok, "prefix " + text)
    start = len(_encode(tok, "prefix"))
    assert "".join(token_texts(tok, ids, start)) == tok.decode(ids[start:], skip_special_tokens=False)


def test_viewer_structure_escaping_and_colourings(tok, tmp_path):
    samples = _samples(tok)
    path = write_trajectory_viewer(
        [s.to_dict() for s in samples], tok, tmp_path / "viewer.html", title="run <demo> & co"
    )
    page = path.read_text(encoding="utf-8")

    # Self-contained: no network, one <style>, our two <script>s and no more.
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", page)
    assert "<link" not in page and " src=" not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2
    # The model's `<script>` never reaches the page as markup; it is JSON-escaped text.
    assert EVIL not in page and "<script>alert" not in page and '</script>"' not in page
    assert "\\u003c" in page  # the JSON carries it as \u003c
    assert "<title>run &lt;demo&gt; &amp; co</title>" in page

    # Every sample is listed with its reward, status, fork reason, env and task.
    rows = re.findall(
        r'<tr data-i="(\d+)" data-reward="([^"]*)" data-status="([^"]*)" data-fork="([^"]*)"', page
    )
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert [float(r[1]) for r in rows] == [1.0, 0.0, 0.5, 0.0]
    assert [r[2] for r in rows] == ["completed", "completed", "completed", "truncated"]
    assert [r[3] for r in rows] == ["", "", "prefix_changed", ""]
    for s in samples:
        assert s.sample_id in page and s.task_id in page

    # Filters: reward range, fork reason (with each reason present), status; the colouring toggle.
    assert 'id="rmin"' in page and 'id="rmax"' in page
    assert re.search(r'<select id="fork">.*<option value="prefix_changed">', page)
    assert 'id="status"' in page
    assert 'name="mode" value="mask"' in page and 'name="mode" value="gap"' in page
    assert 'id="legend-gap"' in page and "nats" in page

    data = _data(page)
    records = data["samples"]
    assert len(records) == 4
    for record, s in zip(records, samples, strict=True):
        assert record["id"] == s.sample_id
        assert len(record["tok"]) == s.response_len  # token strings once per sample, one per token
        assert record["mask"] == s.loss_mask
        # Each sample's tokens decode back to its response text.
        assert "".join(record["tok"]) == tok.decode(s.tokens[s.prompt_len :], skip_special_tokens=False)
    assert EVIL in "".join(records[2]["tok"])

    # Loss-mask colouring: the tool sample has env/template tokens (0) between sampled ones (1).
    assert 0 in records[1]["mask"] and records[1]["mask"][0] == 1 and records[1]["mask"][-1] == 1
    # Gap colouring: student − teacher where both exist and the token was sampled; none without a teacher.
    tool = samples[1]
    for k, (m, g) in enumerate(zip(records[1]["mask"], records[1]["gap"], strict=True)):
        if m:
            assert g == pytest.approx(tool.rollout_logprobs[k] - tool.teacher_logprobs[k], abs=1e-3)
        else:
            assert g is None
    assert records[3]["gap"] is None
    assert data["scale"] >= 0.5


def test_viewer_with_no_samples(tok, tmp_path):
    page = write_trajectory_viewer([], tok, tmp_path / "empty.html", title="empty").read_text()
    assert _data(page)["samples"] == []


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_reward_curve_png(tmp_path):
    rows = [{"train/step": 0, "eval/accuracy": 0.2, "eval/teacher_accuracy": 0.7}]
    rows += [
        {"train/step": k, "rollout/reward_mean": 0.1 * k, "rollout/reward_std": 0.2} for k in range(1, 6)
    ]
    rows[-1]["eval/accuracy"] = 0.5
    path = plot_reward_curve(rows, tmp_path / "out" / "reward_curve.png", title="demo", eval_tasks=20)
    width, height = _png_size(path)
    assert 600 <= width <= 2000 and 400 <= height <= 1500
    assert 10_000 < path.stat().st_size < 500_000

    # Reward only (no evaluation, no step key): a smaller single panel, still valid.
    only = plot_reward_curve(
        [{"rollout/reward_mean": 0.5}, {"rollout/reward_mean": float("nan")}], tmp_path / "r.png"
    )
    assert _png_size(only)[1] < height


def test_the_reward_band_stays_within_the_steps_rewards():
    rows = [
        {"train/step": 1, "rollout/reward_mean": 0.1, "rollout/reward_std": 0.3,
         "rollout/reward_min": 0.0, "rollout/reward_max": 1.0},
        {"train/step": 2, "rollout/reward_mean": 0.9, "rollout/reward_std": 0.3,
         "rollout/reward_min": 0.0, "rollout/reward_max": 1.0},
        {"train/step": 3, "rollout/reward_mean": -0.5, "rollout/reward_std": 0.25},  # no range: ± std
        {"train/step": 4, "eval/accuracy": 0.5},  # no reward: no band
    ]  # fmt: skip
    band = [(s, m, round(lo, 6), round(hi, 6)) for s, m, lo, hi in reward_band(rows)]
    assert band == [(1.0, 0.1, 0.0, 0.4), (2.0, 0.9, 0.6, 1.0), (3.0, -0.5, -0.75, -0.25)]


def test_accuracy_points_carry_their_binomial_standard_error():
    rows = [{"eval/accuracy": 0.1}, {"rollout/reward_mean": 0.3}, {"eval/accuracy": 0.25, "eval/tasks": 40.0}]
    points = accuracy_points(rows, eval_tasks=20)
    assert [(s, p) for s, p, _ in points] == [(0.0, 0.1), (2.0, 0.25)]
    assert points[0][2] == pytest.approx((0.1 * 0.9 / 20) ** 0.5)  # 0.067: 0.10 -> 0.25 is ~2 s.e.
    assert points[1][2] == pytest.approx((0.25 * 0.75 / 40) ** 0.5)  # the row's own task count wins
    assert accuracy_points(rows)[0][2] is None  # no task count known: no error bar
