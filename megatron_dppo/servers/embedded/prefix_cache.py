"""The embedded engine's prefix cache: the K/V of token prefixes it has computed, kept for the requests that continue
them, as SGLang's radix cache and vLLM's automatic prefix caching keep theirs.

    a row stops at its token budget (a partial rollout's chunk) ─► insert(its tokens, their K/V per layer)
    a request arrives ─► lookup(prompt + tokens so far): the longest cached prefix ─► the decoder copies its K/V into
        the batch's cache and computes only the tokens after it
    a weight update, /flush_cache ─► clear()

Invariants:
- an entry holds the K/V of exactly its tokens, computed by the weights of the current version: every weight load
  clears the cache before the new weights can serve (the engine's weight routes call `clear`), and generation and
  weight loading never overlap (the engine's model lock), so no entry outlives the weights that computed it;
- a lookup never covers a whole context: the last token is always computed, since its hidden state gives the next
  token's logits;
- the cached tokens, summed over entries, never exceed `capacity` (the engine's KV budget, --max-total-tokens); the
  least recently used entries are evicted first;
- thread-safe: the engine's decode workers look up and insert concurrently.

Entries sit in a trie over token ids, so a lookup walks the context once and finds the longest cached prefix, whether
it was a previous chunk of the same sample or a prompt an earlier request computed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class CachedPrefix:
    """The K/V of the first `length` tokens of a context: per layer [kv_heads, length, head_dim]."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    entry: CachedPrefix | None = None


class PrefixCache:
    """Longest-prefix K/V lookup over token ids, bounded in tokens, least recently used evicted first."""

    def __init__(self, capacity_tokens: int):
        """capacity_tokens 0: a cache that keeps nothing (the engine's --disable-radix-cache)."""
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens={capacity_tokens} must be >= 0")
        self.capacity = capacity_tokens
        self.root = _Node()
        self.recent: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()  # oldest first
        self.tokens = 0  # cached tokens, summed over entries
        self.lock = threading.Lock()
        self.hit_tokens = 0  # tokens served from the cache since the engine started (bench/step_cost.py reads them)
        self.looked_up_tokens = 0  # tokens of the contexts looked up

    def lookup(self, context: list[int]) -> CachedPrefix | None:
        """The longest cached prefix of `context` shorter than it (the last token is always computed), or None."""
        with self.lock:
            node, found = self.root, None
            for token in context[:-1]:
                node = node.children.get(token)
                if node is None:
                    break
                if node.entry is not None:
                    found = node.entry
            self.looked_up_tokens += len(context)
            if found is not None:
                self.recent.move_to_end(found.tokens)
                self.hit_tokens += found.length
            return found

    def insert(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep the K/V (per layer [kv_heads, len(tokens), head_dim], owned by the cache from now on) of `tokens`."""
        tokens = tuple(tokens)
        if not tokens or len(tokens) > self.capacity:
            return
        with self.lock:
            if tokens in self.recent:
                self.recent.move_to_end(tokens)
                return
            while self.tokens + len(tokens) > self.capacity:
                self._evict(next(iter(self.recent)))
            node = self.root
            for token in tokens:
                node = node.children.setdefault(token, _Node())
            node.entry = CachedPrefix(tokens, keys, values)
            self.recent[tokens] = node.entry
            self.tokens += len(tokens)

    def clear(self) -> None:
        with self.lock:
            self.root, self.recent, self.tokens = _Node(), OrderedDict(), 0

    def _evict(self, tokens: tuple[int, ...]) -> None:
        """Drop the entry of `tokens` and the trie nodes that lead to nothing else."""
        self.recent.pop(tokens)
        self.tokens -= len(tokens)
        path = [self.root]
        for token in tokens:
            path.append(path[-1].children[token])
        path[-1].entry = None
        for depth in range(len(tokens), 0, -1):
            node = path[depth]
            if node.entry is not None or node.children:
                break
            del path[depth - 1].children[tokens[depth - 1]]
