"""KV tiers on real models: greedy outputs identical with and without tiers (a tiny random model
and the default model, with blocks loaded back from host and disk), and a restart: a new process
on the same ``disk_cache_dir`` reuses exactly the whole blocks the first one computed, which wrote
them and just returned (the writes drain at interpreter exit)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tier_fakes import loading_always_pays, tiny_model

from radixkv import LLM, SamplingParams

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]


def _turns(llm, convs, params):
    """Replay ``convs`` (lists of user messages) turn by turn; the outputs of every request."""
    hist = [[] for _ in convs]
    outs = []
    for t in range(max(len(c) for c in convs)):
        active = [i for i, c in enumerate(convs) if t < len(c)]
        for i in active:
            hist[i].append({"role": "user", "content": convs[i][t]})
        res = llm.chat([hist[i] for i in active], params, use_tqdm=False)
        # the turn's writes reached the tiers before the next turn's lookups (which do not wait
        # for a queued write: what they find would depend on timing)
        assert llm.engine.kv.tiers is None or llm.engine.kv.tiers.drain(60)
        for i, o in zip(active, res):
            hist[i].append({"role": "assistant", "content": o.outputs[0].text})
            outs.append(o)
    return outs


def _convs(seed, n, turns, words=40):
    rng = random.Random(seed)
    vocab = "alpha beta gamma delta river stone cloud paper music orange window garden".split()
    return [[" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(turns)] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_model_outputs_identical_with_tiers(tmp_path, page_size):
    lm = tiny_model()
    convs = _convs(1, 4, 3)
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = _turns(LLM(loaded_model=lm, device="cpu", max_total_tokens=8192, page_size=page_size), convs, params)
    # a pool far smaller than the working set: turns come back from the host tier (evicted) or disk
    tiered_llm = LLM(
        loaded_model=lm,
        device="cpu",
        max_total_tokens=384,
        page_size=page_size,
        host_cache_bytes=1 << 20,
        disk_cache_dir=str(tmp_path),
    )
    loading_always_pays(tiered_llm.engine)  # what the tiers serve must not depend on timing
    tiered = _turns(tiered_llm, convs, params)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    s = tiered_llm.cache_stats()
    assert s.cached_tokens_by_tier["host"] + s.cached_tokens_by_tier["disk"] > 0
    assert s.cached_tokens == sum(s.cached_tokens_by_tier.values())
    tiered_llm.engine.check_integrity()
    tiered_llm.close()


def test_engines_computing_other_bits_never_share_blocks(tmp_path):
    """Two engines on one disk directory whose forwards compute other K/V bits for the same tokens
    (here the torch attention backend and the native cpu one: layer l's attention output feeds
    layer l+1's K/V) never load each other's blocks; before, the fingerprint named only the
    weights and dtypes, so the second loaded the first's blocks and its outputs were no longer
    the ones it computes itself. An engine like the first reads them."""
    lm = tiny_model()
    prompt = list(range(300, 364))
    params = SamplingParams(temperature=0, max_tokens=4)

    def run(backend: str):
        llm = LLM(loaded_model=lm, device="cpu", attention_backend=backend, disk_cache_dir=str(tmp_path))
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        llm.close()  # the writes drain
        return out

    assert run("torch").cached_tokens_by_tier["disk"] == 0  # the first: nothing stored yet
    assert run("cpu").cached_tokens_by_tier["disk"] == 0  # other bits: the torch engine's blocks are not its own
    assert run("torch").cached_tokens_by_tier["disk"] == 63  # the same producer: all but the last prompt token


def test_default_model_outputs_identical_with_tiers(default_model, tmp_path):
    convs = _convs(2, 3, 3, words=30)
    params = SamplingParams(temperature=0, max_tokens=16)
    plain_llm = LLM(loaded_model=default_model, device="cpu", max_total_tokens=8192)
    plain = _turns(plain_llm, convs, params)
    llm = LLM(
        loaded_model=default_model,
        device="cpu",
        max_total_tokens=400,
        host_cache_bytes=64 << 20,
        disk_cache_dir=str(tmp_path),
    )
    loading_always_pays(llm.engine)
    tiered = _turns(llm, convs, params)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    by = llm.cache_stats().cached_tokens_by_tier
    assert by["host"] + by["disk"] > 0
    # the tiers keep what the small pool evicted: more reuse than the same small pool without
    small = _turns(LLM(loaded_model=default_model, device="cpu", max_total_tokens=400), convs, params)
    assert sum(o.num_cached_tokens for o in tiered) > sum(o.num_cached_tokens for o in small)
    llm.close()


_RESTART = textwrap.dedent(
    """
    import json, sys
    from radixkv import LLM, SamplingParams
    llm = LLM(device="cpu", max_total_tokens=4096, disk_cache_dir=sys.argv[1])
    ids = json.loads(sys.argv[2])
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    print(json.dumps(dict(cached=out.num_cached_tokens, by=out.cached_tokens_by_tier, tokens=out.outputs[0].token_ids)))
    # no close(): the writes queued for the disk tier drain at interpreter exit
    """
)


def test_restart_on_the_same_disk_dir_reuses_exact_blocks(tmp_path, default_model):
    ids = default_model.tokenizer.encode("The history of the printing press, told in detail. " * 12)
    ids = ids[:150]

    def run() -> dict:
        r = subprocess.run(
            [sys.executable, "-c", _RESTART, str(tmp_path / "kv"), json.dumps(ids)],
            capture_output=True,
            text=True,
            timeout=400,
            cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["cached"] == 0
    want = len(ids) - 1  # every token below the last prompt token: the whole blocks, then the tail
    assert second["cached"] == want and second["by"] == {"device": 0, "host": 0, "disk": want, "remote": 0}
    assert second["tokens"] == first["tokens"]


# ---------------------------------------------------------------- K/V dtypes (bf16, fp8 with scales)
def _ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _tiny_llm(lm, kv, disk=None, **kw):
    return LLM(loaded_model=lm, device="cpu", max_total_tokens=1024, kv_cache_dtype=kv, disk_cache_dir=disk, **kw)


def _greedy(llm, ids, n=8):
    return llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=n), use_tqdm=False
    )[0]


def _pool_rows(llm, ids, n):
    """The pool's bytes (every per-slot tensor: K, V and fp8's scales) of the first ``n`` cached
    tokens of ``ids``, and their slots."""
    from radixkv.memory.kv_io import gather_rows

    m = llm.engine.kv.cache.match_prefix(ids[:n], None)
    assert m.length == n
    return gather_rows(llm.engine.runner.kv_pool, m.slots), m.slots


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_low_precision_blocks_come_back_bit_exact_with_their_scales(tmp_path, kv):
    """A bf16 / fp8 pool's blocks go to disk in the pool's dtype (fp8: with their per-token-and-head
    scales) and a new engine loads them bit for bit: the same K, V and scale bytes in its pool,
    the same greedy tokens."""
    import torch

    lm = tiny_model()
    ids = _ids(5, 90)
    want = len(ids) - 1  # 5 whole blocks and 9 tokens of a tail
    a = _tiny_llm(lm, kv, str(tmp_path))
    first = _greedy(a, ids)
    a.close()
    b = _tiny_llm(lm, kv, str(tmp_path))
    second = _greedy(b, ids)
    assert second.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": want, "remote": 0}
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    pool = b.engine.runner.kv_pool
    assert pool.kv_cache_dtype == kv
    rows_a, _ = _pool_rows(a, ids, want)
    rows_b, slots = _pool_rows(b, ids, want)
    assert rows_b.shape == (want, pool.bytes_per_token)  # the whole row: K, V and scales of every layer
    assert torch.equal(rows_a, rows_b)
    if pool.k_scale is not None:  # the scales are the computed ones, not the pool's initial 1s
        assert bool((pool.k_scale_slots(0).index_select(0, torch.as_tensor(slots)) != 1).any())
    b.close()


def test_a_bf16_engine_never_reads_what_a_float32_engine_wrote(tmp_path):
    """A block's key holds the K/V dtype (the model fingerprint), so a bf16 engine restarting on a
    disk directory a float32 engine wrote finds none of its blocks: a plain miss (never read, so
    neither rejected nor corrupt), not float32 bytes read as bf16. Both dtypes' blocks then live in
    the one directory, each engine reading its own."""
    lm = tiny_model()
    ids = _ids(6, 90)
    want = len(ids) - 1  # 5 whole blocks and 9 tokens of a tail
    f32 = _tiny_llm(lm, "float32", str(tmp_path))
    out32 = _greedy(f32, ids)
    f32.close()
    ref16 = _greedy(_tiny_llm(lm, "bfloat16"), ids)
    b16 = _tiny_llm(lm, "bfloat16", str(tmp_path))
    got = _greedy(b16, ids)
    assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == ref16.outputs[0].token_ids
    st = b16.cache_stats().tiers["disk"]
    assert (st["found"], st["loaded"], st["load_rejected"], st["corrupt"]) == (0, 0, 0, 0)
    b16.close()
    again16 = _greedy(_tiny_llm(lm, "bfloat16", str(tmp_path)), ids)
    assert again16.cached_tokens_by_tier["disk"] == want
    assert again16.outputs[0].token_ids == ref16.outputs[0].token_ids
    again32 = _greedy(_tiny_llm(lm, "float32", str(tmp_path)), ids)
    assert again32.cached_tokens_by_tier["disk"] == want
    assert again32.outputs[0].token_ids == out32.outputs[0].token_ids


def test_speculative_decoding_with_tiers_fp8_pages_of_16_keeps_greedy_outputs(tmp_path):
    """Speculative decoding ("radix" drafts: the second round drafts the first round's replies,
    verified rows) over an fp8 pool of 16-token pages whose prompts come back from the host and
    disk tiers: every token is what the plain engine (no tiers, no speculation) gives, drafts are
    accepted, and every prompt of the second round reuses its 6 whole pages, most of them from
    the tiers (the pool holds about two prompts)."""
    lm = tiny_model()
    rng = random.Random(3)
    heads = [[rng.randrange(100, 40000) for _ in range(50)] for _ in range(8)]
    prompts = [h + h[:30] + h[:20] for h in heads]
    params = SamplingParams(temperature=0, max_tokens=24)

    def rounds(llm):
        out = []
        for _ in range(2):
            out.append(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
            assert llm.engine.kv.tiers is None or llm.engine.kv.tiers.drain(60)  # as in _turns
        llm.engine.check_integrity()
        return out

    kw = dict(loaded_model=lm, device="cpu", page_size=16, kv_cache_dtype="fp8_e4m3")
    plain = rounds(LLM(max_total_tokens=8192, **kw))
    llm = LLM(
        max_total_tokens=256,
        speculative_config={"method": "radix", "num_speculative_tokens": 4},
        host_cache_bytes=1 << 16,
        disk_cache_dir=str(tmp_path),
        **kw,
    )
    loading_always_pays(llm.engine)
    tiered = rounds(llm)
    for a, b in zip(plain, tiered):
        assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert [o.num_cached_tokens for o in tiered[1]] == [96] * 8
    from_tiers = sum(o.cached_tokens_by_tier["host"] + o.cached_tokens_by_tier["disk"] for o in tiered[1])
    assert from_tiers >= 96 * 6
    stats = llm.cache_stats()
    assert stats.spec_accepted_tokens > 0
    assert sum(stats.tiers[m]["corrupt"] + stats.tiers[m]["load_rejected"] for m in ("host", "disk")) == 0
    llm.close()


def test_the_same_weights_under_another_config_never_read_each_others_blocks(tmp_path):
    """One checkpoint, two config.json: RoPE's theta changed (as a rope_scaling added for long
    contexts), or the norms' epsilon. Their K/V differ for the same tokens, so neither engine
    reads the other's blocks (the fingerprint named the weights and dtypes only: the second
    engine loaded the first one's 89 tokens from disk and its greedy tokens changed from the 3rd
    on). Where the model was loaded from (``_name_or_path``) does not matter: a copy shares."""
    ids = _ids(7, 90)
    base = tiny_model()
    a = _tiny_llm(base, "float32", str(tmp_path))
    _greedy(a, ids)
    a.close()
    for config in ({"rope_theta": 500000.0}, {"rms_norm_eps": 1e-3}):
        _reads_none_of_the_blocks(tiny_model(**config), ids, tmp_path)
    copy = tiny_model()
    copy.model.config._name_or_path = "/elsewhere/the-same-model"
    again = _greedy(_tiny_llm(copy, "float32", str(tmp_path)), ids)
    assert again.cached_tokens_by_tier["disk"] == len(ids) - 1


def _reads_none_of_the_blocks(model, ids, tmp_path) -> None:
    """An engine of ``model`` over the disk tier at ``tmp_path`` finds none of its blocks for
    ``ids`` and gives the tokens it gives with no tier."""
    alone = _greedy(_tiny_llm(model, "float32"), ids)
    llm = _tiny_llm(model, "float32", str(tmp_path))
    got = _greedy(llm, ids)
    assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.cache_stats().tiers["disk"]["found"] == 0
    llm.close()


def test_int8_models_of_other_projection_weights_never_read_each_others_blocks(tmp_path):
    """Two checkpoints that differ only in a projection's weights (a fine-tune merged into the
    attention, as LoRA does), both with int8 weights: their K/V differ, so neither engine reads
    the other's blocks. The int8 layers keep their weights packed for FBGEMM, outside the
    ``state_dict``, so the fingerprint named only the embeddings and norms: the second engine
    loaded the first's 89 tokens from disk and its greedy tokens were the first model's."""
    import torch

    from radixkv.models.quantize import quantize_model

    ids = _ids(8, 90)
    base, tuned = tiny_model(), tiny_model()
    with torch.no_grad():
        tuned.model.model.layers[0].self_attn.qkv_proj.weight.mul_(1.5)
    for lm in (base, tuned):
        quantize_model(lm.model, "int8")
    a = _tiny_llm(base, "float32", str(tmp_path))
    _greedy(a, ids)
    a.close()
    _reads_none_of_the_blocks(tuned, ids, tmp_path)
    again = _greedy(_tiny_llm(base, "float32", str(tmp_path)), ids)  # the same int8 weights share
    assert again.cached_tokens_by_tier["disk"] == len(ids) - 1


def test_weights_changed_in_place_after_an_engine_never_read_its_blocks(tmp_path):
    """One ``LoadedModel`` whose weights change in place between two engines (a training step,
    a merged adapter): the second engine computes other K/V, so it reads none of the first's
    blocks. The weights' digest was memoized per model object at the first engine, so the second
    engine had the first one's fingerprint, loaded its 89 tokens from disk and its greedy tokens
    were the old weights'. Weights changed back read their blocks again."""
    import torch

    ids = _ids(9, 90)
    lm = tiny_model()
    a = _tiny_llm(lm, "float32", str(tmp_path))
    _greedy(a, ids)
    a.close()
    w = lm.model.model.layers[0].self_attn.qkv_proj.weight
    first = w.detach().clone()
    with torch.no_grad():
        w.mul_(1.5)
    _reads_none_of_the_blocks(lm, ids, tmp_path)
    with torch.no_grad():
        w.copy_(first)  # the first weights, bit for bit
    again = _greedy(_tiny_llm(lm, "float32", str(tmp_path)), ids)
    assert again.cached_tokens_by_tier["disk"] == len(ids) - 1
