"""Judge-model rewards (GenRM, LLM-as-judge): a reward that asks a judge model for a verdict.

    judge = Judge(url="http://127.0.0.1:30001", tokenizer="tiny", parse="score")
    verdict = await judge.verdict(question=task.question, answer=reply, reference=task.answer)
    verdict.score, verdict.text, verdict.failure        # 0.8, "... Score: 0.8", None
    return judge.reward(verdict, correct=...)            # a Reward, or JudgeFailed (on_failure="drop")

The judge is an engine speaking SGLang's ``/generate`` (``palaestra engine serve --model tiny``, an
SGLang server, a router), called at its URL directly: never through the gateway, so its tokens
never become training samples. The prompt is `template` filled with the fields given to `verdict`,
rendered as one user message with the judge's chat template (`tokenizer`: a preset name or a model
folder), sent as token ids; the reply is decoded and read by the parser:

- ``"score"``: the last ``Score: x`` (or ``score = x``) in the reply, a number in [`low`, `high`],
  mapped to [0, 1];
- ``"choice"``: the last of `choices`' keys written as ``[[KEY]]``, scored by its value
  (``{"A": 1.0, "B": 0.0}``: pairwise, or ``{"CORRECT": 1.0, "INCORRECT": 0.0}``);
- ``"package.module:function"``: ``function(text) -> float``, raising ValueError when it cannot read it.

`verdicts` judges many items at once, at most `concurrency` requests in flight (the engine batches
them). Each request has `timeout_s` and is retried `retries` times (connection errors, 5xx, timeouts;
never an unreadable reply: the judge was sampled greedily and would say the same). A judge that
times out or answers what the parser cannot read gives a `Verdict` with ``score`` None and the
``failure`` (``timeout``, ``engine_error``, ``unparsable``): `reward` turns it into 0.0 with the
metric ``judge/failed`` 1 (``on_failure="zero"``) or raises `JudgeFailed` (``"drop"``: the episode
fails with the reason and its samples are dropped), never a silent default.

Recorded per sample: the metrics ``judge/score`` and ``judge/failed`` and ``judge/time_s`` (with the
episode's other metrics), and with `record` a JSONL line per verdict (the session id, the score, the
verdict text, the failure) — the gateway keeps only numbers with a sample.

In an environment's `rollout` the judge is awaited like any other grader: in async training the
episode's reward waits for it, the step does not (other episodes go on).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from palaestra.sdk.environment import Reward

__all__ = ["DEFAULT_TEMPLATE", "Judge", "JudgeFailed", "Verdict", "choice_parser", "score_parser"]

DEFAULT_TEMPLATE = (
    "You grade answers. Question:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Answer to grade:\n{answer}\n\nIs the answer correct? Explain briefly, then end with "
    "'Score: 1' if it is correct or 'Score: 0' if it is not."
)

_TOKENIZER_LOCK = threading.Lock()
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def score_parser(low: float = 0.0, high: float = 1.0) -> Callable[[str], float]:
    """Reads the last ``Score: x`` of a reply, x in [low, high], as a number in [0, 1]."""

    def parse(text: str) -> float:
        found = _SCORE.findall(text)
        if not found:
            raise ValueError("no 'Score: <number>' in the verdict")
        value = float(found[-1])
        if not low <= value <= high:
            raise ValueError(f"score {value} is outside [{low}, {high}]")
        return (value - low) / (high - low)

    return parse


def choice_parser(choices: Mapping[str, float]) -> Callable[[str], float]:
    """Reads the last ``[[KEY]]`` of a reply whose KEY is one of `choices`, as that choice's value."""
    if not choices:
        raise ValueError("choice_parser needs at least one choice")
    pattern = re.compile(r"\[\[(" + "|".join(re.escape(k) for k in choices) + r")\]\]")

    def parse(text: str) -> float:
        found = pattern.findall(text)
        if not found:
            raise ValueError(f"no choice of {sorted(choices)} written as [[KEY]] in the verdict")
        return float(choices[found[-1]])

    return parse


@dataclass(frozen=True)
class Verdict:
    """One judgement: the score (None when it failed), the judge's text and why it failed."""

    score: float | None
    text: str
    failure: Literal["timeout", "engine_error", "unparsable"] | None = None
    reason: str = ""
    """What went wrong, for a failure (the parser's or the engine's words)."""
    seconds: float = 0.0
    attempts: int = 1

    def metrics(self) -> dict[str, float]:
        return {
            "judge/score": self.score if self.score is not None else 0.0,
            "judge/failed": float(self.failure is not None),
            "judge/time_s": round(self.seconds, 4),
        }


class JudgeFailed(RuntimeError):
    """The judge gave no verdict and the judge drops such samples (``on_failure="drop"``)."""


@dataclass
class Judge:
    """A judge model behind an engine URL (module docstring); one per environment, shared by its episodes."""

    url: str
    """The judge engine's base URL (SGLang's ``/generate``): its own engine, not the policy's gateway."""
    tokenizer: str
    """The judge's tokenizer and chat template: a preset name (``tiny``) or a model folder."""
    template: str = DEFAULT_TEMPLATE
    """The judge's prompt; ``{field}`` placeholders are filled from `verdict`'s keyword arguments."""
    parse: str = "score"
    """``score``, ``choice`` (with `choices`) or an import path ``package.module:function``."""
    choices: Mapping[str, float] | None = None
    score_range: tuple[float, float] = (0.0, 1.0)
    """What ``score`` reads: ``Score: x`` with x in this range, mapped to [0, 1]."""
    max_tokens: int = 128
    temperature: float = 0.0
    timeout_s: float = 60.0
    """Seconds one request may take."""
    retries: int = 2
    """Retries of a request that failed to connect, answered 5xx or timed out; `backoff_s` doubling."""
    backoff_s: float = 0.5
    concurrency: int = 16
    """Requests in flight at most (across every episode using this judge)."""
    on_failure: Literal["zero", "drop"] = "zero"
    """A failed verdict is a reward of 0.0 (``judge/failed`` 1) or a failed episode (`JudgeFailed`)."""
    record: str | None = None
    """A JSONL file that gets one line per verdict (text, score, failure); None: metrics only."""
    _parse: Callable[[str], float] = field(init=False, repr=False)
    _tok: Any = field(default=None, init=False, repr=False)
    _http: httpx.AsyncClient | None = field(default=None, init=False, repr=False)
    _loop: Any = field(default=None, init=False, repr=False)
    _gate: asyncio.Semaphore | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.on_failure not in ("zero", "drop"):
            raise ValueError(f"on_failure must be 'zero' or 'drop'; got {self.on_failure!r}")
        if self.concurrency < 1 or self.retries < 0 or not self.timeout_s > 0:
            raise ValueError("concurrency must be at least 1, retries at least 0 and timeout_s positive")
        if self.parse == "score":
            self._parse = score_parser(*self.score_range)
        elif self.parse == "choice":
            self._parse = choice_parser(self.choices or {})
        else:
            from palaestra.plugins import load_object

            self._parse = load_object(self.parse, "judge parser", callable_=True)

    def _tokenizer(self) -> Any:
        with (
            _TOKENIZER_LOCK
        ):  # verdicts render prompts in threads; one loads it (importing is not thread-safe)
            if self._tok is not None:
                return self._tok
            from transformers import AutoTokenizer

            from palaestra.models import resolve_model

            self._tok = AutoTokenizer.from_pretrained(resolve_model(self.tokenizer))
        return self._tok

    def _client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:  # clients and semaphores belong to one loop
            self._http = httpx.AsyncClient(
                base_url=self.url.rstrip("/"), timeout=self.timeout_s, trust_env=False
            )
            self._gate, self._loop = asyncio.Semaphore(self.concurrency), loop
        return self._http, self._gate

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._http = self._loop = self._gate = None

    def prompt_ids(self, **fields: Any) -> list[int]:
        """The judge's prompt for `fields` as token ids (the template as one user message)."""
        try:
            text = self.template.format(**fields)
        except KeyError as exc:
            raise ValueError(
                f"the judge's template needs the field {exc.args[0]!r}; given {sorted(fields)}"
            ) from None
        tok = self._tokenizer()
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tok.encode(rendered, add_special_tokens=False))

    async def verdict(self, session_id: str = "", **fields: Any) -> Verdict:
        """The judge's verdict on `fields` (what `template` names); never raises for the judge's failures."""
        ids = await asyncio.to_thread(self.prompt_ids, **fields)
        http, gate = self._client()
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": self.temperature},
        }
        start = time.perf_counter()
        failure, reason, attempt = "engine_error", "", 0
        async with gate:
            while True:
                attempt += 1
                try:
                    r = await http.post("/generate", json=body)
                except httpx.TimeoutException as exc:
                    failure, reason = "timeout", f"no answer within {self.timeout_s} s ({type(exc).__name__})"
                except httpx.HTTPError as exc:
                    failure, reason = "engine_error", f"{type(exc).__name__}: {exc}"
                else:
                    if r.status_code == 200:
                        failure = None
                        break
                    failure, reason = "engine_error", f"HTTP {r.status_code}: {r.text[:300]}"
                    if r.status_code < 500:
                        break
                if attempt > self.retries:
                    break
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        if failure is not None:
            result = Verdict(None, "", failure, reason, time.perf_counter() - start, attempt)
        else:
            result = self._read(r, time.perf_counter() - start, attempt)
        self._record(session_id, fields, result)
        return result

    def _read(self, r: httpx.Response, seconds: float, attempts: int) -> Verdict:
        try:
            answer = r.json()
            text = self._tokenizer().decode(answer["output_ids"], skip_special_tokens=True)
        except (ValueError, KeyError, TypeError) as exc:
            return Verdict(
                None, r.text[:300], "engine_error", f"not a /generate answer: {exc}", seconds, attempts
            )
        try:
            score = float(self._parse(text))
        except ValueError as exc:
            return Verdict(None, text, "unparsable", str(exc), seconds, attempts)
        return Verdict(score, text, None, "", seconds, attempts)

    def _record(self, session_id: str, fields: Mapping[str, Any], verdict: Verdict) -> None:
        if self.record is None:
            return
        line = {
            "session_id": session_id,
            "score": verdict.score,
            "verdict": verdict.text,
            "failure": verdict.failure,
            "reason": verdict.reason,
            "seconds": round(verdict.seconds, 4),
            "fields": {k: str(v)[:2000] for k, v in fields.items()},
        }
        with open(self.record, "a") as f:
            f.write(json.dumps(line) + "\n")

    async def verdicts(self, items: Sequence[Mapping[str, Any]]) -> list[Verdict]:
        """Verdicts on many items at once (each a dict of template fields, ``session_id`` optional)."""
        return list(await asyncio.gather(*(self.verdict(**item) for item in items)))

    def reward(self, verdict: Verdict, **metrics: float) -> Reward:
        """The episode's `Reward` from `verdict`: its score with the ``judge/*`` metrics and `metrics`;
        a failed verdict is 0.0 (``on_failure="zero"``) or raises `JudgeFailed` (``"drop"``)."""
        if verdict.failure is not None and self.on_failure == "drop":
            raise JudgeFailed(f"the judge failed ({verdict.failure}): {verdict.reason}")
        value = verdict.score if verdict.score is not None else 0.0
        return Reward(value, verdict.metrics() | {k: float(v) for k, v in metrics.items()})
