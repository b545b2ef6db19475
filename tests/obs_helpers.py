"""A model runner without a model, for engine tests whose outcome does not depend on the model's
outputs (prefix-cache hit rates of prompts given as token ids): it keeps the block table and
returns all-zero logits (greedy picks token 0), with the real tokenizer's vocabulary size so
real token ids are accepted."""

from __future__ import annotations

import torch

from radixkv.attention.metadata import ForwardBatch
from radixkv.config import EngineConfig
from radixkv.engine import Engine
from radixkv.memory.kv_pool import ReqToTokenPool


class NullRunner:
    """``build_batch`` like the real runner (the metadata checks run), ``forward`` -> zeros."""

    def __init__(self, vocab_size: int, page_size: int = 1, max_running: int = 16, max_context_len: int = 8192):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context_len)

    def build_batch(self, input_ids, req_rows, prefix_lens, extend_lens, logits_indices=None):
        return ForwardBatch.build(
            input_ids,
            req_rows,
            prefix_lens,
            extend_lens,
            self.req_to_token_pool.req_to_token,
            self.page_size,
            logits_indices=logits_indices,
        )

    def forward(self, b: ForwardBatch) -> torch.Tensor:
        return torch.zeros(b.num_logits, self.vocab_size)


def null_engine(tokenizer=None, vocab_size=None, capacity=32768, page_size=1, cache="radix", **kw) -> Engine:
    """An :class:`Engine` over a :class:`NullRunner` (vocabulary of ``tokenizer`` by default)."""
    vocab = vocab_size or len(tokenizer)
    cfg = EngineConfig(device="cpu", page_size=page_size, max_total_tokens=capacity, prefix_cache=cache, **kw)
    runner = NullRunner(vocab, page_size, cfg.max_running_requests or 16)
    return Engine(cfg, model_runner=runner, tokenizer=tokenizer, eos_token_ids=[])
