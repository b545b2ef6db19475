"""Helpers of the KV-tier engine tests: an in-memory ``PageStore`` and a tiny random model.

``MemoryStore`` conforms to the stores' protocol (radixkv/tiers, tiers_contract.md): it keeps
``Block`` objects in a dict (shareable between engines, as a disk directory or a Redis server is),
verifies the tokens on ``get`` as the codec does, evicts its least recently used blocks beyond
``capacity_bytes``, and fails on demand (``failing``: every call is a miss, counted in
``errors``; ``corrupt(key)``: the stored block no longer verifies, counted in ``corrupt``). The
engine-side tests use it where the real stores are not needed; tests/test_tiers_store_engine.py
runs the engine over the real ``HostStore`` / ``DiskStore``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

from radixkv.tiers import Block


class MemoryStore:
    """A ``PageStore`` in memory (module docstring).

    Args:
        medium: "host", "disk" or "remote".
        capacity_bytes: budget of the payloads held.
        data: the dict holding the blocks (pass one shared dict to several stores to share it).
    """

    def __init__(self, medium: str, capacity_bytes: int = 1 << 40, data: Optional[OrderedDict] = None) -> None:
        self.medium = medium
        self.capacity_bytes = capacity_bytes
        self.data: OrderedDict = data if data is not None else OrderedDict()
        self.failing = False
        self.closed = False
        self._bad: set = set()
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("hits", "misses", "blocks_read", "blocks_written", "bytes_read", "bytes_written", "corrupt", "errors"), 0
        )
        self.puts: list = []  # every key put, in order

    @property
    def used_bytes(self) -> int:
        return sum(len(b.payload) for b in self.data.values())

    def contains(self, keys: Sequence) -> list:
        with self._lock:
            if self.failing:
                self.counts["errors"] += 1
                return [False] * len(keys)
            return [k in self.data for k in keys]

    def get(self, keys: Sequence, tokens: Sequence[tuple]) -> list:
        out = []
        with self._lock:
            for k, t in zip(keys, tokens):
                if self.failing:
                    self.counts["errors"] += 1
                    out.append(None)
                    continue
                b = self.data.get(k)
                if b is None:
                    self.counts["misses"] += 1
                    out.append(None)
                elif k in self._bad or tuple(b.tokens) != tuple(t):
                    self.counts["corrupt"] += 1
                    del self.data[k]
                    self._bad.discard(k)
                    out.append(None)
                else:
                    self.data.move_to_end(k)
                    self.counts["hits"] += 1
                    self.counts["blocks_read"] += 1
                    self.counts["bytes_read"] += len(b.payload)
                    out.append(b)
        return out

    def put(self, keys: Sequence, blocks: Sequence[Block]) -> None:
        with self._lock:
            if self.failing:
                self.counts["errors"] += 1
                return
            for k, b in zip(keys, blocks):
                self.data[k] = b
                self.data.move_to_end(k)
                self.puts.append(k)
                self.counts["blocks_written"] += 1
                self.counts["bytes_written"] += len(b.payload)
            while self.data and sum(len(b.payload) for b in self.data.values()) > self.capacity_bytes:
                self.data.popitem(last=False)

    def corrupt(self, key) -> None:
        """The stored block of ``key`` fails verification from now on."""
        with self._lock:
            self._bad.add(key)

    def delete_all(self) -> None:
        with self._lock:
            self.data.clear()

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts, degraded=self.failing)

    def close(self) -> None:
        self.closed = True


TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)


def tiny_model(seed: int = 0):
    """A random-weight Llama-shaped ``LoadedModel`` (``TINY``) with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig

    from radixkv.models.loader import LoadedModel, build_model, resolve_hf_dir

    hf_dir = resolve_hf_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    cfg = LlamaConfig(**TINY)
    return LoadedModel(build_model(cfg, seed=seed), cfg, tok, "random-llama", hf_dir)
