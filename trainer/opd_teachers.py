"""Where a teacher's logprobs come from (on-policy distillation), in one of two modes.

* megatron: the teacher is a checkpoint of the *same architecture* as the student. It is read
  from disk once into the `teacher` weight snapshot (`load_teacher_tensors`); the trainer scores
  by switching the live model to it, computing logprobs on the step's own micro-batches, and
  switching back.
* sglang: the teacher runs on its own engine(s) (any size, SGLang or the embedded engine) and
  each sample is scored through the engine protocol: `/generate` with ``input_ids`` = the whole
  sample, ``max_new_tokens: 0``, ``return_logprob: true``, ``logprob_start_len: 0``. The answer's
  ``input_token_logprobs`` has one entry per token, the first with a null logprob; entry j is
  log P(token j | tokens before j), so a sample's response logprobs are the entries from
  ``prompt_len`` on (aligned from the end, as docs/engine-protocol.md advises).

Teacher logprobs are at temperature 1 in both modes: SGLang reports prompt logprobs unscaled.

OPD compares token ids, so teacher and student must share a tokenizer. `check_same_tokenizer`
compares a fingerprint of the whole vocabulary when the engine's `/model_info.tokenizer_path` is
readable here. Otherwise (a remote engine) it scores probe tokens with ``return_text_in_logprobs``
and compares the teacher's text for each id with the student's: the tokens of a probe text (digits,
accents, CJK, code, a chat-template marker) and every (vocab/256)-th id — a sample of the
vocabulary, not all of it. A mismatch is a `TeacherError` naming both sides.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from palaestra.sample import Sample
from palaestra.trainer.convert import HFArchitecture, hf_to_megatron

__all__ = [
    "SGLangTeacher",
    "TeacherError",
    "check_same_tokenizer",
    "load_teacher_tensors",
    "tokenizer_fingerprint",
]

PROBE_TEXT = "Teacher probe: 12+30=42, naïve café 東京 <|im_start|>user\ndef f(x):\n    return x**2\n"


class TeacherError(RuntimeError):
    """The teacher cannot score these samples (tokenizer mismatch, bad answer, unreachable engine)."""


def load_teacher_tensors(teacher_dir: str | Path, student: HFArchitecture) -> dict[str, torch.Tensor]:
    """Reads a HF checkpoint once and returns it under Megatron names (same architecture required)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    teacher = HFArchitecture.from_hf_config(AutoConfig.from_pretrained(teacher_dir))
    if teacher != student:
        raise TeacherError(
            f"megatron-mode teacher {teacher_dir} must have the student's architecture "
            f"(it is swapped into the same model); teacher {teacher}, student {student}. "
            "Use opd.teacher_mode='sglang' for a teacher of another size."
        )
    files = sorted(Path(teacher_dir).glob("*.safetensors"))
    if not files:
        raise TeacherError(f"no *.safetensors in {teacher_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return hf_to_megatron(state, student)


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """sha256 over the vocabulary (token -> id) and the added/special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    payload = {
        "vocab": sorted(tok.get_vocab().items(), key=lambda kv: kv[1]),
        "added": sorted((t.content, t.special) for t in tok.added_tokens_decoder.values()),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def _score_entries(client: httpx.Client, url: str, body: dict, routing_key: str | None = None) -> list:
    return _generate(client, url, body, routing_key)["meta_info"]["input_token_logprobs"]


def _generate(client: httpx.Client, url: str, body: dict, routing_key: str | None = None) -> dict:
    headers = {"X-SMG-Routing-Key": routing_key} if routing_key else None
    try:
        r = client.post(f"{url}/generate", json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise TeacherError(f"teacher engine {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise TeacherError(f"teacher engine {url}: HTTP {r.status_code}: {r.text[:300]}")
    answer = r.json()
    return answer[0] if isinstance(answer, list) else answer


def check_same_tokenizer(
    url: str, student_dir: str | Path, timeout: float = 60.0, use_path: bool = True
) -> str:
    """Raises `TeacherError` unless the engine at `url` tokenizes like the student; returns how it checked."""
    from transformers import AutoTokenizer

    with httpx.Client(timeout=timeout, trust_env=False) as client:
        try:
            info = client.get(f"{url}/model_info").json()
        except (httpx.HTTPError, ValueError) as exc:
            raise TeacherError(f"teacher engine {url}: cannot read /model_info: {exc}") from None
        path = info.get("tokenizer_path") or info.get("model_path")
        if use_path and path and Path(path).is_dir():
            theirs, ours = tokenizer_fingerprint(path), tokenizer_fingerprint(student_dir)
            if theirs != ours:
                raise TeacherError(
                    f"teacher engine {url} uses tokenizer {path} (fingerprint {theirs[:12]}) but the student "
                    f"uses {student_dir} (fingerprint {ours[:12]}); OPD needs one tokenizer on both sides"
                )
            return "fingerprint"
        tok = AutoTokenizer.from_pretrained(str(student_dir))
        vocab = len(tok)
        ids = tok.encode(PROBE_TEXT, add_special_tokens=False)
        ids += list(range(0, vocab, max(1, vocab // 256)))
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_text_in_logprobs": True,
        }
        entries = _score_entries(client, url, body)
    for entry in entries:
        token_id, text = entry[1], entry[2]
        mine = tok.convert_ids_to_tokens(token_id)
        decoded = tok.decode([token_id])
        if text not in (mine, decoded):
            raise TeacherError(
                f"teacher engine {url} maps token id {token_id} to {text!r}, the student tokenizer "
                f"{student_dir} to {decoded!r}; OPD needs one tokenizer on both sides"
            )
    return "probe"


class SGLangTeacher:
    """Scores samples on teacher engines through the SGLang protocol (module docstring)."""

    def __init__(
        self, urls: Sequence[str], student_dir: str | Path, concurrency: int = 8, timeout: float = 300.0
    ):
        if not urls:
            raise ValueError("teacher_mode 'sglang' needs at least one teacher URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.concurrency = concurrency
        self.timeout = timeout
        self.checked = {u: check_same_tokenizer(u, student_dir, timeout) for u in self.urls}

    def _score_one(
        self, client: httpx.Client, sample: Sample, topk_ids: torch.Tensor | None = None
    ) -> tuple[list[float], list[list[float]] | None]:
        # One URL per session keeps a session's samples on one engine and its prefix cache.
        url = self.urls[int(hashlib.md5(sample.session_id.encode()).hexdigest(), 16) % len(self.urls)]
        body: dict[str, Any] = {
            "input_ids": list(sample.tokens),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        wanted: list[int] = []
        if topk_ids is not None:  # the union of the student's top-k ids over the response
            wanted = sorted(set(topk_ids.reshape(-1).tolist()))
            body["token_ids_logprob"] = wanted
        answer = _generate(client, url, body, routing_key=sample.session_id)
        entries = answer["meta_info"]["input_token_logprobs"]
        n, p = len(sample.tokens), sample.prompt_len
        if len(entries) < n - 1:
            raise TeacherError(f"teacher engine {url}: {len(entries)} input logprobs for {n} tokens")
        tail = entries[len(entries) - (n - p) :] if n > p else []
        for k, entry in enumerate(tail):
            if entry[1] != sample.tokens[p + k] or entry[0] is None:
                raise TeacherError(
                    f"teacher engine {url}: input_token_logprobs misaligned at response token {k} of "
                    f"sample {sample.sample_id} (entry {entry[:2]}, token {sample.tokens[p + k]})"
                )
        sampled = [float(e[0]) for e in tail]
        if topk_ids is None:
            return sampled, None
        rows = answer["meta_info"].get("input_token_ids_logprobs") or []
        rows = rows[len(rows) - (n - p) :] if n > p else []
        if len(rows) != n - p or any(r is None for r in rows):
            raise TeacherError(
                f"teacher engine {url}: no input_token_ids_logprobs for the response of {sample.sample_id}"
            )
        top = []
        for k, row in enumerate(rows):
            by_id = {int(e[1]): float(e[0]) for e in row}
            top.append([by_id[int(v)] for v in topk_ids[k].tolist()])
        return sampled, top

    def score(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per sample, the teacher's logprob of each response token (temperature 1)."""
        return [sampled for sampled, _ in self.score_with_ids(samples)]

    def score_with_ids(
        self, samples: Sequence[Sample], topk_ids: Sequence[torch.Tensor | None] | None = None
    ) -> list[tuple[list[float], list[list[float]] | None]]:
        """Per sample, (`score`'s logprobs, and with `topk_ids` — [response tokens, k] per sample —
        the teacher's logprobs of those ids at each position, asked for as ``token_ids_logprob`` and
        answered in ``input_token_ids_logprobs``; None without)."""
        ids = list(topk_ids) if topk_ids is not None else [None] * len(samples)
        with httpx.Client(timeout=self.timeout, trust_env=False) as client:
            with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
                return list(pool.map(lambda si: self._score_one(client, *si), zip(samples, ids, strict=True)))
