"""The Sample schema guards its own invariants."""

from __future__ import annotations

import numpy as np
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
    record = s.as_record()  # the same fields, its lists not copied (the gateway's spool line)
    assert record == s.to_dict() and list(record) == list(s.to_dict())
    assert record["tokens"] is s.tokens and s.to_dict()["tokens"] is not s.tokens


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


def _moe_sample() -> Sample:
    # 3 prompt tokens, then 2 sampled, 1 inserted (a turn delimiter), 1 sampled
    sample = Sample("s-0", "s", "g", "math", "t", tokens=[1, 2, 3], prompt_len=3)
    sample.append([4, 5], sampled=True, logprobs=[-0.1, -0.2], weight_version="0")
    sample.append([6], sampled=False)
    sample.append([7], sampled=True, logprobs=[-0.3], weight_version="0")
    return sample


def test_routing_round_trips_through_json_in_the_smallest_type():
    import json

    sample = _moe_sample()
    routing = np.arange(6 * 4 * 2).reshape(6, 4, 2) % 8  # the last sampled token is never run
    sample.set_routing(routing)
    assert sample.routed_experts["dtype"] == "uint8"
    back = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert back.routing().tolist() == routing.tolist()
    wide = _moe_sample()
    wide.set_routing(np.full((7, 1, 1), 300))
    assert wide.routed_experts["dtype"] == "uint16" and int(wide.routing().max()) == 300


def test_routing_that_does_not_cover_the_trained_tokens_is_refused_naming_the_sample():

    sample = _moe_sample()
    with pytest.raises(SampleError, match=r"shape \[5, 4, 2\] for 7 tokens.*6 <= n <= 7 \(sample s-0\)"):
        sample.set_routing(np.zeros((5, 4, 2), dtype=np.int64))
    with pytest.raises(SampleError, match="shape"):
        sample.set_routing(np.zeros((8, 4, 2), dtype=np.int64))
    with pytest.raises(SampleError, match="negative"):
        sample.set_routing(-np.ones((6, 4, 2), dtype=np.int64))
    data = sample.to_dict()
    data["routed_experts"] = {"shape": [2, 4], "dtype": "uint8", "data": ""}
    with pytest.raises(SampleError, match="routed_experts has shape"):
        Sample.from_dict(data)


def test_a_sample_without_routing_reads_as_none():
    assert _moe_sample().routing() is None
