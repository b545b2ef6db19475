"""Logprobs against an independent reference: the default model's sampled-token and prompt logprobs
equal a float64 ``log_softmax`` of transformers' logits (to 1e-4), with ranks exact up to tokens
within that tolerance, and top-k, also through chunked prefill, a paged cache, and the prefix-cache limit that prompt logprobs
impose (a request with prompt logprobs from position ``s`` reuses at most ``s - 1`` cached
tokens; ``num_cached_tokens`` asserted exactly)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.datasets import load_conversations  # noqa: E402
from radixkv.sampling.logprobs import token_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(600)
TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    out = []
    for conv in load_conversations(3, 1, max_user_chars=200):
        msgs = [{"role": "user", "content": conv[0]}]
        out.append(list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)))
    return out


@pytest.fixture(scope="module")
def ref(hf_default):
    """float64 log-softmax of transformers' logits over a whole sequence, memoized."""
    memo = {}

    def run(ids):
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                logits = hf_default(torch.tensor([list(ids)])).logits[0]
            memo[key] = torch.log_softmax(logits.double(), dim=-1)
        return memo[key]

    return run


def check_position(entry, lp_row, token, k):
    """One position's dict against the reference row: the actual token first with its logprob and
    rank (1 + tokens strictly more likely), then the k most likely tokens with theirs."""
    keys = list(entry)
    assert keys[0] == token
    mine = entry[token]
    assert abs(mine.logprob - lp_row[token].item()) < TOL
    # rank = 1 + tokens strictly more likely; a token within TOL of this one may fall on either side
    # (float32 sums in another order, e.g. AVX-512 vs AVX2 kernels), nothing further away may
    lo = 1 + int((lp_row > lp_row[token] + TOL).sum())
    hi = 1 + int((lp_row > lp_row[token] - TOL).sum())
    assert lo <= mine.rank <= hi, (mine.rank, lo, hi)
    top = torch.topk(lp_row, k)
    want_ranks = [r for r in range(1, k + 1) if r != mine.rank]
    assert sorted(v.rank for t, v in entry.items() if t != token) == want_ranks
    for t, v in entry.items():
        assert abs(v.logprob - lp_row[t].item()) < TOL
        if v.rank <= k:
            assert abs(v.logprob - top.values[v.rank - 1].item()) < TOL
    assert mine.decoded_token is not None


def test_sampled_logprobs_equal_transformers(default_model, prompts, ref):
    llm = LLM(device="cpu", loaded_model=default_model, max_total_tokens=4096)
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=k) for k in (5, 0, 20)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        full = ref(prompt + c.token_ids)
        total = 0.0
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = full[len(prompt) + i - 1]
            check_position(entry, row, tok, p.logprobs)
            assert entry[tok].rank == 1  # greedy
            assert entry[tok].decoded_token == default_model.tokenizer.decode([tok])
            total += row[tok].item()
        assert abs(c.cumulative_logprob - total) < TOL * len(c.token_ids)
        assert out.prompt_logprobs is None
    plain = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=8))
    assert plain[0].outputs[0].logprobs is None and plain[0].outputs[0].cumulative_logprob is None
    assert plain[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("page_size,chunk", [(1, 2048), (4, 7)])
def test_prompt_logprobs_equal_transformers_and_limit_the_cache(default_model, prompts, ref, page_size, chunk):
    llm = LLM(
        device="cpu", loaded_model=default_model, max_total_tokens=4096, page_size=page_size, chunked_prefill_size=chunk
    )
    a, b = prompts[0], prompts[1]
    # warm the cache with prompt a (its whole pages are inserted)
    llm.generate(prompt_token_ids=[a], sampling_params=SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    system = 0
    while a[system] == b[system]:
        system += 1  # the shared chat-template header
    assert system > 8
    s = 6
    reqs = [
        (a, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)),  # from position 0: nothing cached
        (a, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprob_start_len=s)),
        (b, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, logprob_start_len=len(b) - 3)),
    ]
    for prompt, p in reqs:
        (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)
        start = p.logprob_start_len
        # the cache serves at most start - 1 tokens (the logits of start - 1 score token start)
        limit = max(start - 1, 0)
        cached = min(limit, (len(a) - 1 if prompt is a else system))
        assert out.num_cached_tokens == cached // page_size * page_size
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        assert all(e is None for e in lps[: max(start, 1)])
        full = ref(prompt)
        for pos in range(max(start, 1), len(prompt)):
            check_position(lps[pos], full[pos - 1], prompt[pos], p.prompt_logprobs)
        assert out.outputs[0].token_ids == ref_greedy(full, prompt, out)
    llm.engine.check_integrity()
    st = llm.cache_stats()
    assert st["protected"] == 0 and st["free"] + st["evictable"] == st["capacity"]


def ref_greedy(full, prompt, out):
    """The first generated token is the argmax at the last prompt position (a sanity anchor)."""
    first = int(torch.argmax(full[len(prompt) - 1]))
    assert out.outputs[0].token_ids[0] == first
    return out.outputs[0].token_ids


def test_prompt_logprobs_with_n_samples_come_once(default_model, prompts, ref):
    llm = LLM(device="cpu", loaded_model=default_model, max_total_tokens=4096)
    p = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=0, logprob_start_len=len(prompts[2]) - 4
    )
    (out,) = llm.generate(prompt_token_ids=[prompts[2]], sampling_params=p, use_tqdm=False)
    full = ref(prompts[2])
    for pos in range(len(prompts[2]) - 4, len(prompts[2])):
        check_position(out.prompt_logprobs[pos], full[pos - 1], prompts[2][pos], 0)
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
    llm.engine.check_integrity()


def test_token_bytes_rebuild_the_text_exactly(default_model):
    """OpenAI's ``bytes``: the tokens of a text with multi-byte characters split across tokens
    (their ``decoded_token`` alone is U+FFFD) concatenate back to its UTF-8."""
    tok = default_model.tokenizer
    text = "café 🚀 naïve, 東京 <|im_end|> ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode("utf-8")
