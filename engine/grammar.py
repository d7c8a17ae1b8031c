"""Constrained decoding in the embedded engine: SGLang's `json_schema`, `regex` and `ebnf` sampling
fields, through llguidance (Rust, CPU, from PyPI; no torch or CUDA dependency of its own).

Why llguidance: it compiles a JSON schema / regex / grammar lazily, without a per-grammar pass over
the vocabulary, and computes each step's mask on CPU, which is where the embedded engine samples;
agents send a new schema per output type, so compile cost per new schema matters. bench/grammar.py
measures it against xgrammar and outlines-core: on Qwen2.5's vocabulary a new small JSON schema
costs llguidance ~1.3 ms per generation, xgrammar ~12x and outlines-core ~240x that
(docs/engine.md has the table).

The mask is applied to the logits after penalties and before the temperature, so the logprob the
engine reports for a sampled token is that of the *constrained* distribution (masked tokens at
-inf, the rest renormalised): docs/engine.md and docs/gateway.md say how the trainer treats it.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from palaestra.engine.protocol import RequestError, SamplingParams

FIELDS = ("json_schema", "regex", "ebnf")


class Constraint:
    """One sequence's grammar state: the allowed next tokens, advanced by each sampled token."""

    def __init__(self, matcher: Any, vocab_size: int):
        import llguidance.torch as lt

        self.matcher = matcher
        self._lt = lt
        self.vocab_size = vocab_size
        self.bitmask = lt.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits of tokens the grammar does not allow next to -inf (in place, one row)."""
        self._lt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        n = self.vocab_size
        self._lt.apply_token_bitmask_inplace(logits[:n].unsqueeze(0), self.bitmask)
        logits[n:] = float("-inf")  # padding rows of the embedding are never text

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)


class Grammars:
    """Compiles a request's constraint against the engine's tokenizer (built on first use)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._ll: Any = None

    def constraint(self, params: SamplingParams) -> Constraint | None:
        given = [(name, getattr(params, name)) for name in FIELDS if getattr(params, name) is not None]
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"only one of sampling_params.{', '.join(FIELDS)} may be set")
        import llguidance
        import llguidance.hf

        if self._ll is None:
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_ids or None)
        name, text = given[0]
        try:
            if name == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(text))
            elif name == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            else:
                from llguidance.gbnf_to_lark import any_to_lark

                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        except (ValueError, TypeError) as exc:
            raise RequestError(f"sampling_params.{name}: {exc}") from None
        matcher = llguidance.LLMatcher(self._ll, grammar)
        if matcher.is_error():
            raise RequestError(f"sampling_params.{name}: {matcher.get_error()}")
        return Constraint(matcher, self._ll.vocab_size)
