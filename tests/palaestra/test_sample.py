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


def test_a_loss_mask_entry_other_than_0_or_1_is_refused_as_python_equality_says():
    """`Sample.validate`'s C-speed check of the mask (`bytearray` of a list) agrees with the reference,
    `m in (0, 1)` for every entry, over random masks of ints, bools, floats, numpy scalars, None,
    strings, in lists, tuples and numpy arrays (an int64 array of 256 reads as bytes 0 and 1)."""
    import random

    rng = random.Random(39)
    odd = [2, -1, 255, 256, 2**70, 0.5, 1.0, 0.0, True, False, None, "1", b"", np.int64(1), np.int64(256),
           np.True_, np.float64(1.0), np.float64(0.5), np.uint8(2)]  # fmt: skip
    for case in range(400):
        mask: list = [rng.randint(0, 1) for _ in range(rng.randint(0, 40))]
        for _ in range(rng.choice([0, 0, 1, 2])):
            mask.insert(rng.randint(0, len(mask)), rng.choice(odd))
        n = len(mask)
        for box in (list, tuple) if case % 4 else (list, tuple, np.array):
            try:
                boxed = box(mask)
            except (TypeError, ValueError):
                continue
            fields = dict(tokens=[1] * (3 + n), rollout_logprobs=[0.0] * n, weight_versions=[""] * n)
            if all(m in (0, 1) for m in boxed):
                make(loss_mask=boxed, **fields)
            else:
                with pytest.raises(SampleError, match="^loss_mask entries must be 0 or 1$"):
                    make(loss_mask=boxed, **fields)
    with pytest.raises(SampleError, match="loss_mask entries must be 0 or 1"):
        make(loss_mask=np.array([256]), tokens=[1, 2, 3, 4], rollout_logprobs=[0.0], weight_versions=[""])


def test_the_routing_must_reach_the_last_true_mask_entry_as_the_python_loop_finds_it():
    """`_check_routing_shape`'s last sampled position (`bytearray(...).rstrip` of a list) against the
    reference loop, over random masks with trailing zeros, large ints, floats and numpy scalars."""
    import random

    from palaestra.sample import _last_sampled

    rng = random.Random(39)
    odd = [0, 1, 2, 256, -3, 0.0, 0.5, True, False, None, np.int64(0), np.int64(7), np.float64(0.0)]
    for _ in range(300):
        mask = [rng.choice([0, 0, 1]) for _ in range(rng.randint(0, 30))] + [0] * rng.randint(0, 5)
        for _ in range(rng.choice([0, 1, 2])):
            mask.insert(rng.randint(0, len(mask)), rng.choice(odd))
        assert _last_sampled(mask) == max((i for i, m in enumerate(mask) if m), default=-1), mask
        assert _last_sampled(tuple(mask)) == _last_sampled(mask)
    sample = _moe_sample()
    sample.loss_mask[-1] = 0  # the last sampled token is now the 5th: routing over 4 positions is enough
    sample.set_routing(np.zeros((4, 1, 1), dtype=np.int64))
    with pytest.raises(
        SampleError, match=r"shape \[3, 1, 1\] for 7 tokens; expected \[n, layers, top_k\] with 4"
    ):
        sample.set_routing(np.zeros((3, 1, 1), dtype=np.int64))


def test_a_prompt_outside_the_tokens_and_misaligned_teacher_logprobs_are_refused():
    with pytest.raises(SampleError, match="prompt_len 4 outside tokens of length 3"):
        make(prompt_len=4)
    with pytest.raises(SampleError, match="teacher_logprobs has 1 entries for 0 response tokens"):
        make(teacher_logprobs=[0.0])


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
