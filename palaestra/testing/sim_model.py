"""The simulated engine's model: its parameter table, a block prefix cache and an SGLang-like scheduler.

No HTTP and no clock here: `SimScheduler` is driven by whoever owns the time (`palaestra/testing/sim.py`
sleeps on asyncio in wall time; the unit tests step a virtual clock), so what it decides is a pure
function of the requests and the times they arrive. It models what matters for placing sessions
on many engines, nothing else:

* **prefill** of the prompt tokens not found in the prefix cache, in chunks of at most
  `chunked_prefill_tokens` per iteration, at `prefill_tokens_per_s`; a waiting prefill runs before
  the next decode step (SGLang runs a new prefill batch first), so a long fresh prompt stalls the
  decoding of every other request on that engine;
* **decode**, one token per running request per step, a step taking
  `decode_step_s + decode_s_per_context_token * (tokens held by the running batch)`: decoding
  is bound by reading the weights and the batch's KV cache from memory;
* **KV capacity** in tokens shared by the running requests and an **LRU prefix cache** of
  `block_tokens`-token blocks (chained hashes: a block is reused only after the same prefix);
  a request is admitted (FCFS) only when its new tokens plus a reserve for its output fit, by
  evicting unused cached blocks, otherwise it **queues**; a running batch that cannot grow
  retracts its newest request, which later re-prefills (SGLang's retraction);
* requests whose prompt continues a prefix another request is still prefilling wait for it, so a
  group of identical prompts is prefilled once (SGLang's in-batch prefix check).

Every answer is `max_new_tokens` tokens long and its ids are a function of the prompt alone, so the
tokens a session sees never depend on which engine served it.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "PARAM_SOURCES",
    "BlockCache",
    "SimParams",
    "SimRequest",
    "SimScheduler",
    "block_hashes",
    "reply_ids",
]


@dataclass(frozen=True)
class SimParams:
    """One engine: Llama-3-8B (bf16; Llama-3.1-8B has the same shape) on one H100, as SGLang serves it.

    Every figure's origin is in `PARAM_SOURCES` and in docs/routing.md. Times are modelled
    seconds; `palaestra/testing/sim.py --time-scale` stretches them in wall time, not here.
    """

    decode_step_s: float = 0.00735
    """Decode step of a batch with (almost) no context: what one step costs at batch 1."""
    decode_s_per_context_token: float = 60e-9
    """Added to a decode step per token of KV held by the running batch (read once per step)."""
    prefill_tokens_per_s: float = 10_723.0
    """Prompt tokens prefilled per second."""
    kv_capacity_tokens: int = 557_684
    """Tokens of KV cache the engine holds (running requests and the prefix cache together)."""
    chunked_prefill_tokens: int = 8192
    """Most prompt tokens prefilled in one iteration (SGLang's --chunked-prefill-size default)."""
    max_running_requests: int = 256
    """Most requests admitted at once (prefilling plus decoding)."""
    output_reserve_ratio: float = 0.7
    """Admission reserves this fraction of a request's max_new_tokens for its output (SGLang's
    initial new-token ratio)."""
    block_tokens: int = 32
    """Prefix-cache granularity: only whole blocks of this many tokens are cached and matched."""

    def __post_init__(self) -> None:
        for name in ("decode_step_s", "prefill_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.decode_s_per_context_token < 0:
            raise ValueError("decode_s_per_context_token must be >= 0")
        for name in ("kv_capacity_tokens", "chunked_prefill_tokens", "max_running_requests", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if not 0 <= self.output_reserve_ratio <= 1:
            raise ValueError(f"output_reserve_ratio must be in [0, 1] (got {self.output_reserve_ratio})")

    def with_overrides(self, **overrides: float) -> SimParams:
        """A copy with some fields replaced; unknown names are an error naming the known ones."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown simulated-engine parameter(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **overrides)


# Where each default comes from (docs/routing.md prints the same table).
PARAM_SOURCES: dict[str, str] = {
    "decode_step_s": (
        "SGLang PR #1401 (sgl-project/sglang, 2024-09): bench_latency, Meta-Llama-3-8B, batch 1, "
        "128 prompt tokens, flashinfer with CUDA graph: median decode latency 7.35 ms; SGLang's CI "
        "requires >= 135 tok/s (<= 7.4 ms) at batch 1 for Llama-3.1-8B (test_bench_one_batch)"
    ),
    "decode_s_per_context_token": (
        "derived from the same figure: a batch-1 step reads the 16.06 GB of bf16 weights in 7.35 ms "
        "(2.19 TB/s effective); a cached token is 128 KiB of K and V (32 layers x 8 KV heads x 128 "
        "dims x 2 x 2 bytes), read at the same rate each step: 60 ns"
    ),
    "prefill_tokens_per_s": (
        "SGLang bench_latency output for Meta-Llama-3-8B, batch 1, 128 prompt tokens: prefill "
        "10,723 tok/s (gist jerryzh168/caa3f3a87f403091b238f85f7b22c20e, 2024-09-26); a short "
        "prompt, so conservative for long ones (see the sensitivity row in docs/routing.md)"
    ),
    "kv_capacity_tokens": (
        "the same SGLang run: max_total_num_tokens=557684 (bf16 KV, 79.41 GB free after loading the weights)"
    ),
    "chunked_prefill_tokens": "SGLang's server default chunked_prefill_size=8192 (as its logged ServerArgs show)",
    "max_running_requests": "a cap for the model (SGLang derives its own from memory); rarely binding here",
    "output_reserve_ratio": "SGLang's initial new-token ratio for admission (0.7)",
    "block_tokens": "model granularity (SGLang's radix cache is per token): keeps matching cheap in Python",
}


def block_hashes(ids: Sequence[int], block: int, known: Sequence[int] = ()) -> list[int]:
    """Chained hashes of the whole `block`-token blocks of `ids`: equal only after an equal prefix.

    `known` are the hashes of a prefix of `ids` computed before; only the blocks after it are hashed.
    """
    out = list(known)
    h = out[-1] if out else 0
    for start in range(len(out) * block, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        out.append(h)
    return out


def reply_ids(
    prompt: Sequence[int], length: int, seed: int = 0, vocab: tuple[int, int] = (1000, 30000)
) -> list[int]:
    """The answer to `prompt`: `length` ids that depend only on the prompt and the request's
    `sampling_seed` (never on the engine that serves it)."""
    rng = random.Random(hash((seed, len(prompt), tuple(prompt[-64:]))))
    return [rng.randrange(*vocab) for _ in range(length)]


@dataclass(slots=True)
class _Block:
    parent: int | None
    refs: int = 0
    children: int = 0
    used: float = 0.0


class BlockCache:
    """An LRU prefix cache of fixed-size blocks keyed by chained hash, with reference counts.

    A block is evictable when no running request holds it and no cached block continues it (a
    leaf), least recently used first, as SGLang's radix cache evicts unreferenced leaves.
    """

    def __init__(self, block: int) -> None:
        self.block = block
        self.blocks: dict[int, _Block] = {}
        self._leaves: list[tuple[float, int]] = []  # heap of (last use, hash); validated when popped

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def lock(self, hashes: Sequence[int], now: float) -> None:
        for h in hashes:
            b = self.blocks[h]
            b.refs += 1
            b.used = now

    def unlock(self, hashes: Sequence[int], now: float) -> None:
        for h in hashes:
            b = self.blocks[h]
            b.refs -= 1
            b.used = now
            if b.refs == 0 and b.children == 0:
                heapq.heappush(self._leaves, (now, h))

    def insert(self, hashes: Sequence[int], now: float, locked: bool) -> int:
        """Adds the blocks of `hashes` not cached yet (their prefix must be); returns how many."""
        added = 0
        parent: int | None = None
        for h in hashes:
            b = self.blocks.get(h)
            if b is None:
                b = self.blocks[h] = _Block(parent)
                if parent is not None:
                    self.blocks[parent].children += 1
                added += 1
                if not locked:
                    heapq.heappush(self._leaves, (now, h))
            elif not locked and b.refs == 0 and b.children == 0:
                heapq.heappush(self._leaves, (now, h))  # its older heap entry goes stale below
            if locked:
                b.refs += 1
            b.used = now
            parent = h
        return added

    def _is_leaf(self, h: int, t: float) -> bool:
        b = self.blocks.get(h)
        return b is not None and b.refs == 0 and b.children == 0 and b.used == t

    def evict(self, tokens: int) -> int:
        """Frees at least `tokens` tokens of unused blocks if it can; returns the tokens freed."""
        freed = 0
        while freed < tokens and self._leaves:
            t, h = heapq.heappop(self._leaves)
            if not self._is_leaf(h, t):
                continue  # stale entry: used, locked or extended since it was pushed
            b = self.blocks.pop(h)
            freed += self.block
            if b.parent is not None:
                p = self.blocks[b.parent]
                p.children -= 1
                if p.refs == 0 and p.children == 0:
                    heapq.heappush(self._leaves, (p.used, b.parent))
        return freed


@dataclass(eq=False)
class SimRequest:
    """One /generate call as the scheduler sees it."""

    prompt: list[int]
    max_new_tokens: int
    arrived: float
    seed: int = 0  # sampling_seed: which answer a prompt gets
    tag: object = None  # the caller's handle (the HTTP layer's future)
    hashes: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at (first) admission
    generated: int = 0
    locked: list[int] = field(default_factory=list)  # block hashes this request holds
    private: int = 0  # KV tokens it holds outside cached blocks
    to_prefill: int = 0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    retractions: int = 0

    @property
    def context(self) -> int:
        return len(self.prompt) + self.generated


@dataclass
class _Iteration:
    kind: str  # "prefill" | "decode"
    start: float
    end: float
    chunk: list[tuple[SimRequest, int]] = field(default_factory=list)  # prefill: tokens per request
    step_s: float = 0.0
    steps: int = 0


@dataclass
class SimStats:
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    retractions: int = 0
    evicted_tokens: int = 0
    max_running: int = 0
    max_waiting: int = 0
    kv_token_s: float = 0.0  # integral of the KV tokens in use over busy time (its mean: / busy_s)
    batch_s: float = 0.0  # integral of the running batch size over decode time


class SimScheduler:
    """One engine's scheduler over modelled time (see the module docstring for what it models).

    `submit(request, now)` queues a request; `advance(now)` applies every iteration that ended by
    `now` and returns the requests that finished; `next_event()` is when the current iteration
    ends (None when idle). Calls must come with non-decreasing `now`.
    """

    def __init__(self, params: SimParams | None = None) -> None:
        self.p = params or SimParams()
        self.cache = BlockCache(self.p.block_tokens)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.pending: set[int] = set()  # block hashes some admitted request is prefilling
        self.current: _Iteration | None = None
        self.private_tokens = 0
        self.stats = SimStats()

    # -- the outside ---------------------------------------------------------------------------
    def submit(self, request: SimRequest, now: float) -> None:
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1 for the simulated engine")
        need = len(request.prompt) + request.max_new_tokens
        if need > self.p.kv_capacity_tokens:
            raise ValueError(
                f"prompt + max_new_tokens = {need} tokens is more than the engine's KV capacity "
                f"({self.p.kv_capacity_tokens}; parameter kv_capacity_tokens)"
            )
        request.hashes = block_hashes(request.prompt, self.p.block_tokens)
        request.output = reply_ids(request.prompt, request.max_new_tokens, request.seed)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt)
        self.waiting.append(request)
        self.stats.max_waiting = max(self.stats.max_waiting, len(self.waiting))
        it = self.current
        if it is None:
            self._plan(now)
        elif it.kind == "decode" and it.steps > 1:
            # the new request joins at the next step boundary: cut the decode segment there
            done = min(it.steps, max(1, -int(-(now - it.start) // it.step_s)))
            it.steps, it.end = done, it.start + done * it.step_s

    def next_event(self) -> float | None:
        return None if self.current is None else self.current.end

    def advance(self, now: float) -> list[SimRequest]:
        finished: list[SimRequest] = []
        while self.current is not None and self.current.end <= now:
            it = self.current
            self.current = None
            self._complete(it, finished)
            self._plan(it.end)
        return finished

    @property
    def used_tokens(self) -> int:
        return self.cache.tokens + self.private_tokens

    def load(self) -> dict[str, int]:
        return {
            "waiting": len(self.waiting),
            "prefilling": len(self.prefilling),
            "running": len(self.running),
            "kv_used_tokens": self.used_tokens,
            "kv_cached_tokens": self.cache.tokens,
        }

    # -- planning -----------------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        self._admit(now)
        if self.prefilling:
            self._plan_prefill(now)
        elif self.running:
            self._plan_decode(now)

    def _free(self, need: int) -> bool:
        """Whether `need` more tokens fit, evicting unused cached blocks for them if it must."""
        short = self.used_tokens + need - self.p.kv_capacity_tokens
        if short > 0:
            self.stats.evicted_tokens += self.cache.evict(short)
        return self.used_tokens + need <= self.p.kv_capacity_tokens

    def _admit(self, now: float) -> None:
        deferred: list[SimRequest] = []
        while self.waiting and len(self.prefilling) + len(self.running) < self.p.max_running_requests:
            req = self.waiting[0]
            hit = self.cache.match(req.hashes)
            if hit < len(req.hashes) and req.hashes[hit] in self.pending:
                deferred.append(self.waiting.popleft())  # its prefix is being prefilled: wait for it
                continue
            tokens = req.context  # a retracted request re-prefills what it had generated too
            new = tokens - hit * self.p.block_tokens
            reserve = int((req.max_new_tokens - req.generated) * self.p.output_reserve_ratio)
            self.cache.lock(req.hashes[:hit], now)  # before evicting: its own hit must stay
            if not self._free(new + reserve):
                self.cache.unlock(req.hashes[:hit], now)
                break  # FCFS: the head waits for memory, and so does everyone behind it
            self.waiting.popleft()
            req.locked = req.hashes[:hit]
            req.private = new
            self.private_tokens += new
            req.to_prefill = max(1, new)  # a full hit still computes its last token
            if req.admitted is None:
                req.admitted = now
                req.cached_tokens = hit * self.p.block_tokens
                self.stats.cached_tokens += req.cached_tokens
            self.pending.update(req.hashes[hit:])
            self.prefilling.append(req)
        self.waiting.extendleft(reversed(deferred))

    def _plan_prefill(self, now: float) -> None:
        budget = self.p.chunked_prefill_tokens
        chunk: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(req.to_prefill, budget)
            chunk.append((req, take))
            budget -= take
        tokens = self.p.chunked_prefill_tokens - budget
        self.current = _Iteration("prefill", now, now + tokens / self.p.prefill_tokens_per_s, chunk)

    def _plan_decode(self, now: float) -> None:
        batch = len(self.running)
        steps = min(r.max_new_tokens - r.generated for r in self.running)
        room = self.p.kv_capacity_tokens - self.used_tokens
        if room < batch * steps:
            self._free(batch * steps - room)
            room = self.p.kv_capacity_tokens - self.used_tokens
        while room < batch:  # not even one step fits: retract the newest request
            self._retract(self.running.pop(), now)
            batch = len(self.running)
            if not batch:
                self._plan(now)
                return
            room = self.p.kv_capacity_tokens - self.used_tokens
        steps = max(1, min(steps, room // batch))
        context = sum(r.context for r in self.running) + batch * (steps - 1) / 2  # mean over the segment
        step_s = self.p.decode_step_s + self.p.decode_s_per_context_token * context
        self.current = _Iteration("decode", now, now + steps * step_s, step_s=step_s, steps=steps)

    def _retract(self, req: SimRequest, now: float) -> None:
        self.cache.unlock(req.locked, now)
        req.locked = []
        self.private_tokens -= req.private
        req.private = 0
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    # -- completing ---------------------------------------------------------------------------
    def _complete(self, it: _Iteration, finished: list[SimRequest]) -> None:
        duration = it.end - it.start
        self.stats.busy_s += duration
        self.stats.kv_token_s += duration * self.used_tokens
        if it.kind == "prefill":
            self.stats.prefill_s += duration
            for req, take in it.chunk:
                req.to_prefill -= take
                self.stats.prefilled_tokens += take
                if req.to_prefill == 0:
                    self._prefilled(req, it.end, finished)
        else:
            self.stats.decode_s += duration
            self.stats.batch_s += duration * len(self.running)
            self.stats.generated_tokens += it.steps * len(self.running)
            self.private_tokens += it.steps * len(self.running)
            still: list[SimRequest] = []
            for req in self.running:
                req.generated += it.steps
                req.private += it.steps
                if req.generated >= req.max_new_tokens:
                    self._finish(req, it.end, finished)
                else:
                    still.append(req)
            self.running = still
        self.stats.max_running = max(self.stats.max_running, len(self.running) + len(self.prefilling))

    def _prefilled(self, req: SimRequest, now: float, finished: list[SimRequest]) -> None:
        """The prompt is in KV: its whole blocks join the cache (held by the request), and the
        prefill's forward pass sampled the first output token."""
        self.prefilling.remove(req)
        fresh = req.hashes[len(req.locked) :]
        self.pending.difference_update(fresh)
        self.cache.insert(
            req.hashes, now, locked=False
        )  # any block another request added meanwhile is shared
        self.cache.lock(fresh, now)
        req.locked = list(req.hashes)
        moved = len(fresh) * self.p.block_tokens
        req.private -= moved
        self.private_tokens -= moved
        if req.first_token is None:
            req.first_token = now
        if req.generated == 0:
            req.generated = 1
            req.private += 1
            self.private_tokens += 1
            self.stats.generated_tokens += 1
        if req.generated >= req.max_new_tokens:
            self._finish(req, now, finished)
        else:
            self.running.append(req)

    def _finish(self, req: SimRequest, now: float, finished: list[SimRequest]) -> None:
        """Prompt + output stay in the prefix cache (unused, so evictable), as SGLang keeps them."""
        self.private_tokens -= req.private
        req.private = 0
        full = block_hashes(req.prompt + req.output, self.p.block_tokens, req.hashes)
        self.cache.insert(full, now, locked=False)
        self.cache.unlock(req.locked, now)
        req.locked = []
        req.finished = now
        self.stats.finished += 1
        finished.append(req)
