"""Shared helpers for the model-side tests: a tiny slot manager over a ModelRunner.

Pages are handed out in a shuffled order so requests never get contiguous KV, which exercises
the page table (kv_indptr / kv_indices / kv_last_page_len) for real.
"""

from __future__ import annotations

import random

import torch

from radixkv.executor.model_runner import ModelRunner


class PagedRequests:
    """Minimal engine stand-in: owns req_to_token rows and page assignment for test requests."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        ps = runner.page_size
        pages = list(range(runner.kv_pool.num_pages))
        random.Random(seed).shuffle(pages)
        self.free_pages = pages
        self.ps = ps
        self.rows: dict[str, int] = {}
        self.lens: dict[str, int] = {}
        self.pages: dict[str, list[int]] = {}

    def _ensure(self, rid: str, new_len: int) -> None:
        """Give request ``rid`` slots for positions up to ``new_len`` and write them to its row."""
        if rid not in self.rows:
            row = self.runner.req_to_token_pool.alloc()
            assert row is not None
            self.rows[rid], self.lens[rid], self.pages[rid] = row, 0, []
        pages = self.pages[rid]
        while len(pages) * self.ps < new_len:
            pages.append(self.free_pages.pop())
        slots = torch.tensor([pages[p // self.ps] * self.ps + p % self.ps for p in range(new_len)])
        self.runner.req_to_token_pool.write(self.rows[rid], 0, slots)

    def forward(self, items: list[tuple[str, list[int]]], all_logits: bool = False) -> list[torch.Tensor]:
        """One forward over ``items`` = [(request id, new token ids)]; each request continues from
        what it already has. Returns per request its logits: all new rows (``all_logits``) or
        the last row, float32 ``[n, vocab]``."""
        rows, prefix, extend, ids = [], [], [], []
        for rid, toks in items:
            start = self.lens.get(rid, 0)
            self._ensure(rid, start + len(toks))
            rows.append(self.rows[rid])
            prefix.append(start)
            extend.append(len(toks))
            ids.extend(toks)
        logits_idx = None
        if all_logits:
            logits_idx = list(range(len(ids)))
        batch = self.runner.build_batch(ids, rows, prefix, extend, logits_indices=logits_idx)
        logits = self.runner.forward(batch)
        out, off = [], 0
        for (rid, _toks), e in zip(items, extend):
            self.lens[rid] += e
            if all_logits:
                out.append(logits[off : off + e])
            else:
                out.append(logits[len(out) : len(out) + 1])
            off += e
        return out


TINY_LLAMA = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
"""The tiny random Llama of the engine-level tests (2 layers, 2 KV heads of 16: 512 float32 K/V
bytes per token), with the default model's tokenizer (as ``radixkv.router.ray``'s test replicas)."""


def tiny_loaded_model(seed: int = 0):
    """A ``LoadedModel`` of :data:`TINY_LLAMA` with random weights (``seed``) and the default
    model's tokenizer, for ``LLM(loaded_model=...)`` / ``Engine(loaded_model=...)``."""
    from transformers import AutoTokenizer, LlamaConfig

    from radixkv.models.loader import LoadedModel, build_model, resolve_hf_dir

    hf_dir = resolve_hf_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    cfg = LlamaConfig(**TINY_LLAMA)
    cfg.architectures = ["LlamaForCausalLM"]
    return LoadedModel(build_model(cfg, seed=seed), cfg, tok, "tiny-random-llama", hf_dir)
