"""The Sample schema guards its own invariants."""

from __future__ import annotations

import pytest

from palaestra.sample import SCHEMA_VERSION, Sample, SampleError, sample_id_for


def make(**kw):
    base = dict(
        sample_id="s",
        session_id="sess",
        group_id="g",
        env="math",
        task_id="t1",
        tokens=[1, 2, 3],
        prompt_len=3,
    )
    return Sample(**{**base, **kw})


def test_append_keeps_fields_aligned():
    s = make()
    s.append([4, 5], sampled=True, logprobs=[-0.1, -0.2], weight_version="v1")
    s.append([6], sampled=False)
    assert s.tokens == [1, 2, 3, 4, 5, 6]
    assert s.loss_mask == [1, 1, 0]
    assert s.rollout_logprobs == [-0.1, -0.2, 0.0]
    assert s.weight_versions == ["v1", "v1", ""]
    assert s.num_sampled == 2 and s.response_len == 3
    assert Sample.from_dict(s.to_dict()) == s


def test_misaligned_fields_are_refused_with_lengths():
    with pytest.raises(SampleError, match="loss_mask has 1 entries for 2 response tokens"):
        make(tokens=[1, 2, 3, 4, 5], loss_mask=[1], rollout_logprobs=[0.0, 0.0], weight_versions=["", ""])
    s = make()
    with pytest.raises(SampleError, match="2 sampled tokens need as many logprobs, got 1"):
        s.append([4, 5], sampled=True, logprobs=[-0.1])
    with pytest.raises(SampleError, match="status"):
        make(status="great")


def test_ids_are_deterministic_and_versions_checked():
    assert sample_id_for("abc", 0) == sample_id_for("abc", 0) != sample_id_for("abc", 1)
    data = make().to_dict()
    data["schema_version"] = "2.0"
    with pytest.raises(SampleError, match="not readable"):
        Sample.from_dict(data)
    assert make().schema_version == SCHEMA_VERSION
