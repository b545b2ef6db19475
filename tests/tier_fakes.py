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

import random
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from radixkv.tiers import Block
from radixkv.tiers.base import keeps_held


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
        with self._lock:  # the I/O thread may be writing
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
                elif k in self._bad or (t is not None and tuple(b.tokens) != tuple(t)):
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

    def put(self, keys: Sequence, blocks: Sequence[Block], replace: bool = False) -> None:
        with self._lock:
            if self.failing:
                self.counts["errors"] += 1
                return
            for k, b in zip(keys, blocks):
                held = self.data.get(k)
                if held is not None and (not replace or keeps_held(held.tokens, b.tokens)):
                    self.data.move_to_end(k)  # as the stores: held, only marked used
                    continue
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


def tiny_model(seed: int = 0, **config):
    """A random-weight Llama-shaped ``LoadedModel`` (``TINY``, with ``config`` over it; the
    weights depend on the seed and the shapes only) with the default model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig

    from radixkv.models.loader import LoadedModel, build_model, resolve_hf_dir

    hf_dir = resolve_hf_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    cfg = LlamaConfig(**{**TINY, **config})
    return LoadedModel(build_model(cfg, seed=seed), cfg, tok, "random-llama", hf_dir)


# ---------------------------------------------------------------------------- a runner over a real pool
VOCAB = 64
_MASK = (1 << 40) - 1


def next_token(tokens) -> int:
    """The fake model's greedy next token after ``tokens`` (as tests/test_scheduler.py's)."""
    import zlib

    return 1 + zlib.crc32(bytes(str(list(tokens)), "ascii")) % (VOCAB - 1)


def prompt_of(n: int, seed: int = 0) -> list:
    """A deterministic prompt of ``n`` tokens of the fake vocabulary (the same in every process)."""
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def reference(prompt, max_tokens):
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def chain(h: int, tok: int) -> int:
    """The K/V hash of a position from its predecessor's and its token."""
    return (h * 1000003 + tok + 1) & _MASK


def kv_row(tok: int, pos: int, h: int) -> list:
    """What layer 0's K holds for a position: token, position, the 40-bit prefix hash as two
    20-bit halves (exact in float32, also the V and layer-1 functions of it)."""
    return [float(tok), float(pos), float(h & 0xFFFFF), float(h >> 20)]


class KVRunner:
    """A model stand-in that keeps its K/V in a real ``KVPool`` (float32, 2 layers, 1 head of 4):
    position ``p`` of a sequence holds :func:`kv_row` (its token, ``p``, the chained hash of
    tokens ``0..p``). A forward writes its new tokens' rows (each from its predecessor's row read
    through the page table, so a borrowed or loaded prefix is used as is), then reads every row's
    context back and checks each position's K/V against the tokens read so far: K/V loaded for
    other tokens, another position or another prefix fails the forward (AssertionError). The
    logits are one-hot on :func:`next_token` of the context, so outputs equal :func:`reference`.
    """

    def __init__(self, num_slots, page_size, max_running=16, max_context_len=1024, fingerprint="kv-runner"):
        from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

        self.kv_pool = KVPool(2, 1, 4, num_slots, page_size, dtype=torch.float32)
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.vocab_size = VOCAB
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context_len)
        self.fingerprint = fingerprint

    def build_batch(self, input_ids, req_rows, prefix_lens, extend_lens, logits_indices=None):
        from radixkv.attention.metadata import ForwardBatch

        return ForwardBatch.build(
            input_ids,
            req_rows,
            prefix_lens,
            extend_lens,
            self.req_to_token_pool.req_to_token,
            self.page_size,
            logits_indices=logits_indices,
        )

    def _write(self, slot: int, row: list) -> None:
        p = self.kv_pool
        k = torch.tensor(row, dtype=torch.float32).view(1, 4)
        p.k_slots(0)[slot] = k
        p.v_slots(0)[slot] = k + 0.5
        p.k_slots(1)[slot] = k * 2
        p.v_slots(1)[slot] = k * 2 + 0.5

    def _read(self, slot: int) -> tuple:
        p = self.kv_pool
        k = p.k_slots(0)[slot, 0].tolist()
        assert p.v_slots(0)[slot, 0].tolist() == [x + 0.5 for x in k], f"slot {slot}: V disagrees with K"
        assert p.k_slots(1)[slot, 0].tolist() == [2 * x for x in k], f"slot {slot}: layer 1 disagrees"
        assert p.v_slots(1)[slot, 0].tolist() == [2 * x + 0.5 for x in k], f"slot {slot}: layer 1 V disagrees"
        return int(k[0]), int(k[1]), int(k[2]) | (int(k[3]) << 20)

    def forward(self, b):
        ps = self.page_size
        qo, kvp, pages = b.qo_indptr_cpu.tolist(), b.kv_indptr_cpu.tolist(), b.kv_indices.tolist()
        ids, out_slots = b.input_ids.tolist(), b.out_slots.tolist()
        prefix = b.prefix_lens_cpu.tolist()

        def slot_of(i, p):
            return pages[kvp[i] + p // ps] * ps + p % ps

        for i in range(b.batch_size):  # rows in order: a row borrows only from rows before it
            for j in range(qo[i], qo[i + 1]):
                p = prefix[i] + j - qo[i]
                h = self._read(slot_of(i, p - 1))[2] if p else 0
                self._write(out_slots[j], kv_row(ids[j], p, chain(h, ids[j])))
        contexts = []
        for i in range(b.batch_size):
            toks, h = [], 0
            for p in range(int(b.seq_lens_cpu[i])):
                tok, pos, got = self._read(slot_of(i, p))
                h = chain(h, tok)
                assert pos == p and got == h, f"row {i} position {p}: K/V of position {pos} / another prefix"
                toks.append(tok)
            contexts.append(toks)
        out = torch.full((b.num_logits, VOCAB), -1e9)
        for j, row in enumerate(b.logits_indices.tolist()):
            i = next(k for k in range(b.batch_size) if qo[k] <= row < qo[k + 1])
            out[j, next_token(contexts[i][: prefix[i] + row - qo[i] + 1])] = 10.0
        return out


def loading_always_pays(engine) -> None:
    """Fix ``engine``'s tier cost rule (docs/tiers.md, "Cost rule") to "loading a block always
    beats recomputing it". The rule decides from measured seconds: a load timed while the I/O
    thread waited for the GIL or the CPU (a loaded 2-core CI machine) looks dearer than a prefill
    and the blocks after it are recomputed, so a test asserting what is served from a tier would
    pass or fail by timing. A test of the rule itself sets ``costs`` by hand. For the same reason
    a step never waits for the lookups it starts (``CostModel.lookup_wait_s`` is 0: no step time
    is measured) unless a test sets ``step_s`` itself."""
    costs = engine.kv.tiers.costs
    costs.note_load = costs.note_prefill = costs.note_step = lambda *_: None
    costs.prefill_token_s, costs.step_s = 1.0, None


def kv_engine(
    capacity=256,
    page_size=1,
    stores=(),
    chunk=64,
    max_running=16,
    cache="radix",
    measured_costs=False,
    first_token_preemption=False,
    **cfg,
):
    """An ``Engine`` over a :class:`KVRunner` of ``capacity`` slots with the KV tier ``stores``;
    unless ``measured_costs``, with :func:`loading_always_pays` (its tests' counts never depend
    on timing)."""
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    config = EngineConfig(
        model="kv-runner",
        device="cpu",
        page_size=page_size,
        max_total_tokens=capacity,
        prefix_cache=cache,
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        first_token_preemption=first_token_preemption,
        **cfg,
    )
    runner = KVRunner(capacity, page_size, max_running)
    engine = Engine(config, model_runner=runner, tokenizer=None, eos_token_ids=[], tier_stores=list(stores) or None)
    if engine.kv.tiers is not None and not measured_costs:
        loading_always_pays(engine)
    return engine


def run_all(engine, check_every_step=True, max_steps=None):
    """Step ``engine`` until idle; the finished outputs by request id. ``max_steps``: fail
    (AssertionError) when more step calls than that do not finish (a livelock)."""
    done = {}
    calls = 0
    while engine.has_unfinished_requests():
        calls += 1
        assert max_steps is None or calls <= max_steps, f"not finished after {max_steps} steps"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            engine.check_integrity()
    return done


def pool_holds_its_tokens(engine) -> int:
    """Check that every slot the prefix cache holds has exactly the K/V of its path's tokens
    (:func:`kv_row`); returns how many slots were checked (0 for caches other than the radix
    tree, whose nodes it walks)."""
    cache, runner = engine.kv.cache, engine.runner
    n = 0
    if not hasattr(cache, "root"):
        return n
    stack = [(c, [], 0) for c in cache.root.children.values()]
    while stack:
        node, toks, h = stack.pop()
        for tok, slot in zip(node.tokens(), node.slots()):
            h = chain(h, tok)
            got = runner._read(slot)
            assert got == (tok, len(toks), h), f"slot {slot}: {got} for token {tok} at {len(toks)}"
            toks = toks + [tok]
            n += 1
        stack.extend((c, toks, h) for c in node.children.values())
    return n
