"""Prefix cache: keeps the KV of finished sequences so a session's next turn skips its history.

A session's turn k+1 prompt is turn k's prompt + sampled tokens + new messages, so its longest
cached prefix is turn k's whole sequence. Entries are kept LRU under a byte budget; an entry whose
tokens are a prefix of a newly inserted one is dropped (the new one serves every lookup it could).
Matching is a vectorised longest-common-prefix over the entries (bounded in count), which costs
well under a millisecond at the budgets used here.

Entries carry a `key`: the KV of a sequence depends on the weights that computed it, so a request
served with a LoRA adapter matches only entries of that adapter (its load's uid; None = the base
model), and `drop(key)` forgets an unloaded adapter's entries.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from palaestra.engine.model_runner import SeqKV


@dataclass
class _Entry:
    tokens: np.ndarray
    kv: SeqKV
    nbytes: int
    key: int | None = None


class PrefixCache:
    def __init__(self, budget_bytes: int, max_entries: int = 512):
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _common(a: np.ndarray, b: np.ndarray) -> int:
        n = min(len(a), len(b))
        if n == 0:
            return 0
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if len(diff) else n

    def match(self, tokens: list[int], limit: int, key: int | None = None) -> tuple[int, SeqKV | None]:
        """Longest cached prefix of `tokens` among the entries of `key`, at most `limit` tokens long."""
        if limit <= 0 or not self._entries:
            return 0, None
        query = np.asarray(tokens[:limit], dtype=np.int64)
        best_id, best_n = None, 0
        for eid, entry in self._entries.items():
            if entry.key != key:
                continue
            n = self._common(entry.tokens, query)
            if n > best_n:
                best_id, best_n = eid, n
        if best_id is None:
            return 0, None
        self._entries.move_to_end(best_id)
        return best_n, self._entries[best_id].kv.prefix(best_n)

    def insert(self, tokens: list[int], kv: SeqKV, key: int | None = None) -> None:
        if self.budget_bytes <= 0 or not tokens:
            return
        arr = np.asarray(tokens[: kv.length], dtype=np.int64)
        for eid in [
            e
            for e, ent in self._entries.items()
            if ent.key == key and self._common(ent.tokens, arr) == len(ent.tokens)
        ]:
            self.bytes -= self._entries.pop(eid).nbytes
        entry = _Entry(arr, kv, kv.nbytes(), key)
        if entry.nbytes > self.budget_bytes:
            return
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.bytes += entry.nbytes
        while self.bytes > self.budget_bytes or len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes

    def drop(self, key: int | None) -> None:
        """Forgets every entry of `key`."""
        for eid in [e for e, ent in self._entries.items() if ent.key == key]:
            self.bytes -= self._entries.pop(eid).nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
