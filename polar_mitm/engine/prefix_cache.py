"""Reuse the KV cache of an earlier call whose tokens start the new prompt: SGLang's radix cache, in small.

An agent's calls grow by appending: turn k+1's prompt is turn k's prompt, its answer and a tool result. Without
reuse every call re-prefills the whole history (20k tokens: seconds per call on CPU, most of a long harness session's
wall time). A finished generation leaves its cache here, keyed by the tokens it holds; the next prompt takes the
entry with the longest common prefix, crops it to that prefix and prefills only the rest.

Entries are taken, never shared: a cache is mutated by the forward passes that extend it, so it belongs to one
generation at a time. A weight update empties the pool (those keys and values came from other weights). The pool is
bounded by the bytes of its tensors; the least recently used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIN_REUSE_TOKENS = 64  # below this a fresh prefill costs about the same as the bookkeeping
DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass
class Entry:
    tokens: list[int]
    cache: Any  # a transformers DynamicCache holding exactly `tokens`
    nbytes: int


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a DynamicCache's key/value tensors."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and hasattr(tensor, "numel"):
                total += tensor.numel() * tensor.element_size()
    return total


class PrefixCache:
    """A small LRU pool of KV caches keyed by the token ids they hold."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next_key = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def take(self, prompt_ids: Sequence[int]) -> tuple[Any, int] | None:
        """The cache sharing the longest prefix with `prompt_ids`, cropped to it, and that length; None if no entry
        shares at least MIN_REUSE_TOKENS. At least the prompt's last token is left to prefill (its logits start
        decoding)."""
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            n = common_prefix_length(entry.tokens, prompt_ids)
            if n > best_len:
                best_key, best_len = key, n
        best_len = min(best_len, len(prompt_ids) - 1)
        if best_key is None or best_len < MIN_REUSE_TOKENS:
            return None
        entry = self._entries.pop(best_key)
        held = len(entry.tokens)
        if held > best_len:
            entry.cache.crop(best_len - held)  # transformers 5: a negative count of tokens to drop
        self.hits += 1
        self.reused_tokens += best_len
        return entry.cache, best_len

    def put(self, tokens: Sequence[int], cache: Any) -> None:
        """Keep `cache`, which holds the keys and values of exactly `tokens`, for a later prompt to extend."""
        if self.budget_bytes <= 0 or len(tokens) < MIN_REUSE_TOKENS:
            return
        nbytes = cache_nbytes(cache)
        if nbytes > self.budget_bytes:
            return
        self._entries[self._next_key] = Entry(list(tokens), cache, nbytes)
        self._next_key += 1
        while self.nbytes > self.budget_bytes:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
