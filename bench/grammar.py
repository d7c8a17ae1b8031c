"""Grammar libraries for the embedded engine's constrained decoding, measured side by side.

    .venv/bin/python -m pip install --no-deps --target /tmp/gram \\
        xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 outlines-core==0.2.14   # throwaway, not in pyproject
    .venv/bin/python -m bench.grammar --extra-path /tmp/gram [--models tiny,tiny-qwen2.5] [--reps 10]

For each model preset's tokenizer (`tiny`: a 4096-token BPE; `tiny-qwen2.5`: Qwen2.5's real ~150k
vocabulary) and each library (llguidance, which engine/grammar.py uses; xgrammar; outlines-core):

* tokenizer setup: the one-off per-engine work on the vocabulary;
* compile: a small JSON schema from nothing to the first next-token mask (xgrammar's compiler cache
  is off and it runs single-threaded, so every repetition is a cold compile; llguidance compiles
  lazily, so its first mask carries the work);
* per gen: compile plus every later mask of one generation (llguidance's lazy compile spreads
  work over the first steps, so this is the fair total);
* mask p50/p99: each later step's mask into a torch bitmask, over a ~50-token constrained
  generation driven by forced tokens (a fixed valid document, tokenized; each forced token is
  checked against the mask, so a library that rejects valid JSON fails loudly here).

Prints absolute times and ratios against llguidance, measured in one run. A library that does not
import prints "not available: <reason>". Only CPU is used (the embedded engine masks on CPU).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import common

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
# One valid document (compact separators: the form every library's default accepts).
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace of the Analytical Engine",
        "age": 36,
        "email": "ada.lovelace@example.org",
        "tags": ["mathematics", "poetical science", "notes on the engine", "Bernoulli numbers"],
        "active": True,
    },
    separators=(",", ":"),
)


class Library:
    """One grammar library behind a few calls: load() (the imports, untimed), setup(tokenizer),
    compile(schema) -> a matcher state, fill(state, bitmask) and advance(state, token)."""

    name = ""

    def load(self) -> None: ...
    def setup(self, tokenizer: Any, vocab_size: int, eos: int) -> None: ...
    def compile(self, schema: dict) -> Any: ...
    def fill(self, state: Any, bitmask: Any) -> None: ...
    def advance(self, state: Any, token: int) -> None: ...


class LLGuidance(Library):
    name = "llguidance"

    def load(self):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.lt = llguidance, llguidance.torch

    def setup(self, tokenizer, vocab_size, eos):
        self.tok = self.ll.hf.from_tokenizer(tokenizer, eos_token=eos)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, state, bitmask):
        self.lt.fill_next_token_bitmask(state, bitmask, 0)

    def advance(self, state, token):
        assert state.consume_token(token), state.get_error()


class XGrammar(Library):
    name = "xgrammar"

    def load(self):
        import xgrammar

        self.xgr = xgrammar

    def setup(self, tokenizer, vocab_size, eos):
        self.info = self.xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=[eos]
        )

    def compile(self, schema):
        # a fresh compiler without its cache: every call is the cold compile a new schema costs
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, state, bitmask):
        state.fill_next_token_bitmask(bitmask)

    def advance(self, state, token):
        assert state.accept_token(token), f"xgrammar rejected token {token}"


class OutlinesCore(Library):
    name = "outlines-core"

    def load(self):
        import outlines_core
        import outlines_core.json_schema

        self.oc = outlines_core

    def setup(self, tokenizer, vocab_size, eos):
        # Vocabulary wants each token's bytes: undo the byte-level BPE's printable-character map.
        unmap = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():
            if i in special or i == eos:
                continue
            raw = bytes(unmap[c] for c in token) if all(c in unmap for c in token) else token.encode()
            tokens.setdefault(raw, []).append(i)
        self.vocab = self.oc.Vocabulary(eos, tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def fill(self, state, bitmask):
        state.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def advance(self, state, token):
        state.advance(token)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(lib: Library, tokenizer: Any, vocab_size: int, eos: int, reps: int) -> dict[str, float]:
    import torch

    setup_s, _ = _timed(lambda: lib.setup(tokenizer, vocab_size, eos))
    forced = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    words = (vocab_size + 31) // 32
    compiles, masks, totals = [], [], []
    for _ in range(reps):
        bitmask = torch.zeros(1, words, dtype=torch.int32)

        def first(bitmask=bitmask):
            state = lib.compile(SCHEMA)
            lib.fill(state, bitmask)
            return state

        t, state = _timed(first)
        compiles.append(t)
        before = len(masks)
        for i, token in enumerate(forced):
            if i:
                t0 = time.perf_counter()
                lib.fill(state, bitmask)
                masks.append(time.perf_counter() - t0)
            allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
            assert allowed, f"{lib.name}: forced token {i} ({token}) not allowed by the mask"
            lib.advance(state, token)
        totals.append(t + sum(masks[before:]))
    masks.sort()
    return {
        "setup_s": setup_s,
        "compile_s": statistics.median(compiles),
        "mask_p50_s": masks[len(masks) // 2],
        "mask_p99_s": masks[min(len(masks) - 1, int(len(masks) * 0.99))],
        "total_s": statistics.median(totals),
    }


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--extra-path", default="", help="a folder with the candidate libraries (pip --target)")
    ap.add_argument("--models", default="tiny,tiny-qwen2.5", help="model presets whose tokenizers to use")
    ap.add_argument("--reps", type=int, default=10, help="generations per library (cold compile each)")
    args = ap.parse_args()
    if args.extra_path:
        sys.path.append(args.extra_path)  # appended: never shadows the project's own torch

    import torch
    from transformers import AutoTokenizer

    from palaestra.models import resolve_model

    torch.set_num_threads(1)
    for preset in args.models.split(","):
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(preset))
        vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id
        n = len(tokenizer.encode(DOCUMENT, add_special_tokens=False))
        print(f"\n== {preset}: vocab {vocab_size}, {n} forced tokens, {args.reps} generations ==")
        rows: dict[str, dict[str, float]] = {}
        for lib in (LLGuidance(), XGrammar(), OutlinesCore()):
            try:
                lib.load()
            except ImportError as exc:
                print(f"{lib.name:14s} not available: {type(exc).__name__}: {exc}")
                continue
            rows[lib.name] = measure(lib, tokenizer, vocab_size, eos, args.reps)
        base = rows.get("llguidance")
        keys = ("setup_s", "compile_s", "mask_p50_s", "mask_p99_s", "total_s")
        print(
            f"{'library':14s} {'setup':>9s} {'compile':>9s} {'mask p50':>9s} {'mask p99':>9s} {'per gen':>9s}"
        )
        for name, r in rows.items():
            print(
                f"{name:14s} {r['setup_s'] * 1e3:7.1f}ms {r['compile_s'] * 1e3:7.2f}ms "
                f"{r['mask_p50_s'] * 1e6:7.1f}us {r['mask_p99_s'] * 1e6:7.1f}us {r['total_s'] * 1e3:7.2f}ms"
            )
        if base:
            for name, r in rows.items():
                print(f"{name + ' / llguidance':28s} " + " ".join(f"{r[k] / base[k]:9.2f}" for k in keys))


if __name__ == "__main__":
    main()
