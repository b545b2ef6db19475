"""Engine step time with the per-request cache outcome on vs off (``EngineConfig.cache_outcome``).

What the outcome costs: at each first admission one read-only ``peek`` of the radix tree, and on
a miss the prompt's 16-token block digests and a comparison with the running requests; the
tracker also subscribes to ``CacheEvicted``, so every eviction computes its block digests. To see
that cost and not the model's, the engine runs over a runner without a model (all-zero logits:
the step is the scheduler, the KV manager, the tree and the sampler); ``--model`` adds the same
comparison on the default model (a step there is dominated by the forward pass).

Workload: ShareGPT multi-turn conversations (bench/workloads ``multi_turn``: every turn's prompt is
the whole history) sent in waves of ``--batch`` requests, at a KV capacity small enough that the
cache evicts. On and off runs alternate, ``--repeats`` times each; the printed ratio is the
median of the per-pair ratios of mean step time (on / off; 1.00 = no cost).

Usage::

    python bench/explain_overhead.py                 # null runner, ~1 min
    python bench/explain_overhead.py --model         # + the default model (a few minutes on CPU)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from bench.workloads import multi_turn  # noqa: E402
from radixkv.attention.metadata import ForwardBatch  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402
from radixkv.engine import Engine  # noqa: E402
from radixkv.memory.kv_pool import ReqToTokenPool  # noqa: E402
from radixkv.sampling_params import SamplingParams  # noqa: E402


class NullRunner:
    """Block table + ``build_batch`` like the real runner; ``forward`` returns zero logits."""

    def __init__(self, vocab: int, page_size: int, rows: int, ctx: int) -> None:
        self.vocab_size, self.page_size, self.max_context_len = vocab, page_size, ctx
        self.req_to_token_pool = ReqToTokenPool(rows, ctx)

    def build_batch(self, input_ids, req_rows, prefix_lens, extend_lens, logits_indices=None):
        return ForwardBatch.build(
            input_ids, req_rows, prefix_lens, extend_lens, self.req_to_token_pool.req_to_token, self.page_size,
            logits_indices=logits_indices,
        )  # fmt: skip

    def forward(self, b):
        return torch.zeros(b.num_logits, self.vocab_size)


def run(prompts, on: bool, capacity: int, batch: int, max_tokens: int, loaded=None) -> tuple[float, int, dict]:
    """Serve ``prompts`` in waves; returns (seconds inside ``step()``, steps, cache stats)."""
    kw = dict(device="cpu", max_total_tokens=capacity, cache_outcome=on, max_running_requests=batch)
    if loaded is None:
        ctx = max(len(p) for p in prompts) + max_tokens + 1
        eng = Engine(EngineConfig(**kw), model_runner=NullRunner(49152, 1, batch, ctx), eos_token_ids=[])
    else:
        eng = Engine(EngineConfig(model="smollm2-135m", **kw), loaded_model=loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    spent, steps = 0.0, 0
    for s in range(0, len(prompts), batch):
        for p in prompts[s : s + batch]:
            eng.add_request(p, params)
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            spent += time.perf_counter() - t0
            steps += 1
    eng.check_integrity()
    return spent, steps, eng.cache_stats().as_dict()


def compare(prompts, capacity, batch, max_tokens, repeats, loaded=None, label="null runner") -> dict:
    """On / off step-time ratios of ``repeats`` alternating pairs (printed); returns them and their
    median."""
    ratios = []
    for k in range(repeats):
        order = (True, False) if k % 2 == 0 else (False, True)
        res = {on: run(prompts, on, capacity, batch, max_tokens, loaded) for on in order}
        (t_on, n_on, s_on), (t_off, n_off, s_off) = res[True], res[False]
        assert n_on == n_off and s_on["cached_tokens"] == s_off["cached_tokens"], "on and off must serve alike"
        ratios.append((t_on / n_on) / (t_off / n_off))
        print(
            f"[{label}] repeat {k + 1}: {n_on} steps, step {1e3 * t_on / n_on:.3f} ms on / {1e3 * t_off / n_off:.3f} ms off"
            f" = {ratios[-1]:.3f}; hit rate {s_on['hit_rate']:.3f}, evicted {s_on['evicted_tokens']:,} tokens",
            flush=True,
        )
    med = statistics.median(ratios)
    print(
        f"[{label}] step time with cache_outcome on / off: median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    return dict(requests=len(prompts), batch=batch, max_tokens=max_tokens, median_ratio=med, ratios=ratios)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16, help="requests sent together (default 16)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=24576, help="KV slots (small enough to evict)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--model", action="store_true", help="also on the default model (fewer requests)")
    ap.add_argument("--out", default=None, help="result JSON path (default bench/results/explain_overhead_<time>.json)")
    args = ap.parse_args(argv)
    t0 = time.time()
    from radixkv.sim.sharegpt import load_conversations

    data = load_conversations()
    wl = multi_turn(n_conversations=args.conversations, concurrency=args.batch, max_context=4096, seed=0, data=data)
    prompts = [wl.full_prompt(i) for i in range(len(wl.requests))]
    print(f"{len(prompts)} requests, {sum(map(len, prompts)):,} prompt tokens, capacity {args.capacity:,}")
    fields = dict(
        capacity=args.capacity, null_runner=compare(prompts, args.capacity, args.batch, args.max_tokens, args.repeats)
    )
    if args.model:
        from radixkv.models.loader import load_model

        loaded = load_model("smollm2-135m", "cpu", torch.float32)
        few = prompts[:48]
        fields["default_model"] = compare(few, args.capacity, 8, 4, 2, loaded, label="default model")
    path = write_result(
        "explain_overhead", fields, args.out, argv=argv, started=t0, machine={"torch": torch.__version__}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
