"""Exploratory: AsyncLLM with every feature on, concurrent asyncio tasks (some leave their stream
early, some are cancelled), sessions/fork, flushes between waves; greedy outputs vs a reference
Engine (up to near-ties), invariants at the end. python tests/stress/combo_stress_async.py [--seed S]"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from combo_stress import NAMESPACES, build_prompts, near_tie, random_params, run_alone  # noqa: E402

from radixkv import AsyncLLM  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402
from radixkv.engine import Engine  # noqa: E402
from radixkv.sampling_params import SamplingParams  # noqa: E402


async def one(llm, p, sp, ns, leave_after, results, key):
    n = 0
    last = None
    async for out in llm.generate(prompt_token_ids=p, sampling_params=sp, namespace=ns):
        n += 1
        last = out
        if leave_after is not None and n >= leave_after:
            return
    by = last.cached_tokens_by_tier
    assert sum(by.values()) == last.num_cached_tokens, (last.num_cached_tokens, by)
    results.append((key, last))


async def main_async(args):
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    from radixkv.models import load_model

    loaded = load_model("smollm2-135m", "cpu", torch.float32)
    prompts = build_prompts(loaded.tokenizer, args.conv, 3, 300)
    ref = Engine(EngineConfig(device="cpu", max_total_tokens=8192), loaded_model=loaded)
    tmp = tempfile.mkdtemp()
    llm = AsyncLLM(
        loaded_model=loaded,
        device="cpu",
        max_total_tokens=args.pool,
        page_size=16,
        chunked_prefill_size=48,
        kv_cache_dtype=args.kv,
        host_cache_bytes=64 << 20,
        disk_cache_dir=tmp,
        speculative_config={"method": "radix", "num_speculative_tokens": 5},
        max_running_requests=8,
    )
    refcache = {}
    nmis = nties = ndone = 0
    try:
        for wave in range(args.waves):
            tasks, results = [], []
            for _ in range(rng.randint(4, 10)):
                p = rng.choice(prompts)
                kind, sp = random_params(rng)
                ns = rng.choice(NAMESPACES)
                key = (tuple(p), repr(sp), ns)
                if key not in refcache:
                    refcache[key] = (kind, run_alone(ref, p, sp, ns))
                leave = rng.choice([None, None, None, 1, 3])
                tasks.append(asyncio.create_task(one(llm, p, sp, ns, leave, results, key)))
            if rng.random() < 0.3:
                await asyncio.sleep(0.2)
                tasks[0].cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for t in tasks:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            for key, out in results:
                ndone += 1
                kind, exp = refcache[key]
                for c, e in zip(out.outputs, exp.outputs):
                    if (c.token_ids, c.finish_reason) != (e.token_ids, e.finish_reason):
                        if near_tie(c.token_ids, e):
                            nties += 1
                            continue
                        nmis += 1
                        print("MISMATCH", wave, kind, "\n got", c.token_ids, "\n exp", e.token_ids, flush=True)
            st = await asyncio.get_running_loop().run_in_executor(None, llm.get_cache_stats)
            print(f"wave {wave}: {len(results)} done, stats retr {st['num_retractions']} running {st['running']}")
            if rng.random() < 0.5:
                assert await llm.reset_prefix_cache(tiers=True)
        assert await llm.reset_prefix_cache()

        def check(engine):
            engine.check_integrity()
            s = engine.cache_stats()
            assert s["free"] == s["capacity"], s
            return s["free"]

        print("free", await llm.call_in_engine_thread(check))
        # a session + fork on the loaded engine
        async with llm.session([{"role": "user", "content": "Count to five."}]) as s:
            r = await s.chat(None, SamplingParams(temperature=0, max_tokens=8))
            async with await s.fork(2) as kids:
                outs = await kids.chat(None, [SamplingParams(temperature=0.8, seed=i, max_tokens=8) for i in range(2)])
            print("session", r.outputs[0].text, [o.outputs[0].text for o in outs])
        assert await llm.reset_prefix_cache()
        print("free after session", await llm.call_in_engine_thread(check))
    finally:
        llm.shutdown()
    print("done", ndone, "mismatches", nmis, "near-ties", nties)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--conv", type=int, default=6)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--kv", default="float32")
    asyncio.run(main_async(ap.parse_args()))
