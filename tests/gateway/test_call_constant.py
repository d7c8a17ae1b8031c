"""Issue 39's per-call work, against the slow reference path it replaced: the same strings for
random inputs."""

from __future__ import annotations

import random

import pytest

from palaestra.gateway.engine_side.generation import FinishReason, Generation
from palaestra.gateway.renderer import ChatRenderer
from palaestra.gateway.service import GatewayService


def _service(tok) -> GatewayService:
    """A service with just what `_text_of` reads: the renderer and its kept token texts."""
    svc = GatewayService.__new__(GatewayService)
    svc.renderer = ChatRenderer(tok, context_length=4096)
    svc._one_token = {}
    return svc


def _reference(svc: GatewayService, gen: Generation) -> tuple[str, str]:
    """`_text_of` as it was: the whole answer decoded, and again without its stop token."""
    ids, matched = gen.output_ids, gen.finish_reason.matched
    full = svc.renderer.decode(ids)
    text = svc.renderer.decode(ids[:-1]) if ids and isinstance(matched, int) else full
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text, full


def _ids(tok, rng: random.Random) -> list[int]:
    """Ids an answer may hold: pieces of multi-byte text (tokens that split a character), plain
    words, special tokens, and any id of the vocabulary."""
    pieces = ["héllo wörld", "日本語のテキスト", "emoji 🤖🎉 ok", " spaces  ", "<think>x</think>", "\ufffd"]
    specials = list(tok.all_special_ids)
    out: list[int] = []
    for _ in range(rng.randint(0, 6)):
        kind = rng.random()
        if kind < 0.5:
            enc = tok.encode(rng.choice(pieces), add_special_tokens=False)
            a = rng.randint(0, len(enc))
            out += enc[a : a + rng.randint(1, 4)]
        elif kind < 0.7:
            out.append(rng.choice(specials))
        else:
            out.append(rng.randrange(len(tok)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_text_of_is_the_reference_for_random_answers(tok, seed):
    svc = _service(tok)
    assert svc.renderer.decode_concatenates  # else the fast path is never taken: the test proves nothing
    rng = random.Random(seed)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = _ids(tok, rng)
        last = rng.random()
        if last < 0.5:  # ended on a stop token: a special one, or any id a request named
            ids.append(rng.choice(specials) if rng.random() < 0.7 else rng.randrange(len(tok)))
            wire = {"type": "stop", "matched": ids[-1]}
        elif last < 0.7:
            wire = {"type": "stop", "matched": rng.choice(["o", "日", "\ufffd", "zz"])}
        elif last < 0.9:
            wire = {"type": "length", "length": len(ids)}
        else:
            wire = {"type": "abort"}
        gen = Generation(ids, [0.0] * len(ids), None, FinishReason(wire), "default")
        assert svc._text_of(gen) == _reference(svc, gen), (ids, wire)


def test_an_answer_that_ends_mid_character_is_decoded_whole(tok):
    svc = _service(tok)
    emoji = tok.encode("🤖", add_special_tokens=False)
    assert len(emoji) > 1  # a character split over tokens
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*emoji[:-1], end]  # the text before the stop token ends on a partial character
    gen = Generation(ids, [0.0] * len(ids), None, FinishReason({"type": "stop", "matched": end}), "default")
    assert svc._text_of(gen) == _reference(svc, gen)
    assert svc._one_token == {}  # decoded whole, not joined
    ids = [*emoji, end]
    gen = Generation(ids, [0.0] * len(ids), None, FinishReason({"type": "stop", "matched": end}), "default")
    assert svc._text_of(gen) == ("🤖", "🤖<|im_end|>")
    assert svc._one_token == {end: "<|im_end|>"}
