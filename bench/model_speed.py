"""Model speed: radixkv's ModelRunner vs transformers, measured side by side in the same run.

Prefill tokens/s for one prompt of each length in ``--prefill-lens`` and decode tokens/s at each
batch size in ``--decode-batches`` (each request has a ``--context``-token prompt, then
``--decode-steps`` greedy steps are timed; prefill is excluded). transformers runs its own KV
cache (``DynamicCache``) with the same weights (the radixkv cache directory of the model), same
dtype, same threads; decode is also timed through ``generate(do_sample=False)`` (what most users
call; its decode steps are timed inside the call). Each measure runs ``--repeats`` times,
alternating radixkv and transformers, and keeps each one's best time (shared machines are noisy).
Prints the ratios radixkv / transformers.

    python bench/model_speed.py                       # default model, CPU, fp32
    python bench/model_speed.py --decode-batches 1 16 --prefill-lens 512 2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's radixkv, not whichever one is installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from radixkv.executor.model_runner import ModelRunner  # noqa: E402
from radixkv.models import load_model  # noqa: E402


def _tokens(n: int, batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, n), generator=g)


class _Ours:
    def __init__(
        self, loaded, num_slots: int, max_batch: int, max_len: int, backend: str, quantization: str | None = None
    ) -> None:
        self.runner = ModelRunner(
            loaded,
            num_slots=num_slots,
            page_size=1,
            max_running_requests=max_batch,
            max_context_len=max_len,
            attention_backend=backend,
            quantization=quantization,
        )

    def _setup(self, batch: int, total_len: int) -> list[int]:
        pool = self.runner.req_to_token_pool
        rows = [pool.alloc() for _ in range(batch)]
        for i, r in enumerate(rows):
            pool.write(r, 0, torch.arange(i * total_len, (i + 1) * total_len))
        return rows

    def _release(self, rows: list[int]) -> None:
        for r in rows:
            self.runner.req_to_token_pool.free(r)

    def prefill(self, ids: torch.Tensor) -> float:
        rows = self._setup(1, ids.shape[1])
        batch = self.runner.build_batch(ids[0], rows, [0], [ids.shape[1]])
        t = time.perf_counter()
        self.runner.forward(batch)
        dt = time.perf_counter() - t
        self._release(rows)
        return dt

    def decode(self, ids: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
        bs, n = ids.shape
        rows = self._setup(bs, n + steps)
        batch = self.runner.build_batch(ids.reshape(-1), rows, [0] * bs, [n] * bs)
        nxt = self.runner.forward(batch).argmax(-1)
        out = [nxt]
        t = time.perf_counter()
        for s in range(steps):
            batch = self.runner.build_batch(nxt, rows, [n + s] * bs, [1] * bs)
            nxt = self.runner.forward(batch).argmax(-1)
            out.append(nxt)
        dt = time.perf_counter() - t
        self._release(rows)
        return dt, torch.stack(out, 1)


class _HF:
    def __init__(self, hf_dir, dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, local_files_only=True).eval()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> float:
        t = time.perf_counter()
        self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        toks = [nxt]
        t = time.perf_counter()
        for _ in range(steps):
            out = self.model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(nxt)
        return time.perf_counter() - t, torch.stack(toks, 1)

    @torch.inference_mode()
    def decode_generate(self, ids: torch.Tensor, steps: int) -> float:
        """Decode seconds inside one ``generate(do_sample=False)`` call: a logits processor stamps
        the time after every forward, and the span from the prefill's stamp to the last one covers
        exactly ``steps`` decode steps (measured in the call, not as a difference of two calls,
        whose prefill times alone differ by more than the decode time's noise)."""
        from transformers import LogitsProcessor, LogitsProcessorList

        class Stamp(LogitsProcessor):
            def __init__(self) -> None:
                self.t: list[float] = []

            def __call__(self, input_ids, scores):
                self.t.append(time.perf_counter())
                return scores

        stamp = Stamp()
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            logits_processor=LogitsProcessorList([stamp]),
        )
        if len(stamp.t) != steps + 1:
            raise RuntimeError(f"generate() ran {len(stamp.t)} forwards, expected {steps + 1}")
        return stamp.t[-1] - stamp.t[0]


def _prefill_rows(ours, hf, quant: dict, prefill_lens: list, vocab: int, repeats: int) -> list:
    """Prefill tok/s of one prompt per length, radixkv (and its quantized copies) vs transformers:
    printed, and returned as rows."""
    rows = []
    for n in prefill_lens:
        ids = _tokens(n, 1, vocab, n)
        ta, tb = float("inf"), float("inf")
        tq = {q: float("inf") for q in quant}
        for _ in range(repeats):  # alternate them and keep each one's best run
            ta, tb = min(ta, ours.prefill(ids)), min(tb, hf.prefill(ids))
            for q, qo in quant.items():
                tq[q] = min(tq[q], qo.prefill(ids))
        a, b = n / ta, n / tb
        print(f"{f'prefill {n} tokens (tok/s)':<34}{a:>12.1f}{b:>14.1f}{a / b:>7.2f}x")
        row = dict(tokens=n, radixkv_tok_s=a, transformers_tok_s=b, quantized_tok_s={})
        for q in quant:
            aq = row["quantized_tok_s"][q] = n / tq[q]
            print(f"{f'  radixkv {q}, prefill {n}':<34}{aq:>12.1f}{b:>14.1f}{aq / b:>7.2f}x")
        rows.append(row)
    return rows


def _decode_rows(ours, hf, quant: dict, args: argparse.Namespace, vocab: int) -> list:
    """Decode tok/s per batch size, radixkv (and its quantized copies) vs transformers' loop and
    ``generate()``, with the share of equal greedy tokens: printed, and returned as rows."""
    rows = []
    for bs in args.decode_batches:
        ids = _tokens(args.context, bs, vocab, 1000 + bs)
        ta = tb = tc = float("inf")
        tq = {q: float("inf") for q in quant}
        toks_q = {}
        for _ in range(max(1, args.repeats)):
            t, toks_a = ours.decode(ids, args.decode_steps)
            ta = min(ta, t)
            for q, qo in quant.items():
                t, toks_q[q] = qo.decode(ids, args.decode_steps)
                tq[q] = min(tq[q], t)
            t, toks_b = hf.decode(ids, args.decode_steps)
            tb = min(tb, t)
            tc = min(tc, hf.decode_generate(ids, args.decode_steps))
        a, b, c = (bs * args.decode_steps / x for x in (ta, tb, tc))
        same = (toks_a == toks_b).float().mean().item()
        print(
            f"{f'decode batch {bs} (tok/s)':<34}{a:>12.1f}{b:>14.1f}{a / b:>7.2f}x{c:>12.1f}{a / c:>7.2f}x"
            f"   same greedy tokens {same:.0%}"
        )
        row = dict(batch=bs, radixkv_tok_s=a, transformers_tok_s=b, generate_tok_s=c, same_greedy_tokens=same)
        row["quantized"] = {}
        for q in quant:
            aq = bs * args.decode_steps / tq[q]
            sq = (toks_q[q] == toks_a).float().mean().item()
            row["quantized"][q] = dict(tok_s=aq, greedy_tokens_equal_to_fp32=sq)
            print(
                f"{f'  radixkv {q}, decode batch {bs}':<34}{aq:>12.1f}{b:>14.1f}{aq / b:>7.2f}x{c:>12.1f}{aq / c:>7.2f}x"
                f"   greedy tokens equal to fp32 {sq:.0%}"
            )
        rows.append(row)
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefill-lens", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request before decoding")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs per measure (alternating); the best is kept")
    ap.add_argument("--backend", default="auto", help="attention backend (auto: cpu when the native kernels work)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument(
        "--pack-formats",
        nargs="+",
        default=None,
        help="formats the native GEMM may store weights in, tried in order (default: "
        "q4_1 q8_0 f32, the lossless block formats first; 'f32' alone: plain float32 panels)",
    )
    ap.add_argument(
        "--quantization",
        nargs="*",
        default=["int8"],
        help="also time radixkv with these weight quantizations (rows 'radixkv int8'); none: fp32 only",
    )
    ap.add_argument("--out", default=None, help="result JSON path (default bench/results/model_speed_<time>.json)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    t0 = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    loaded = load_model(args.model, device="cpu", dtype=torch.float32)
    pack_formats = tuple(args.pack_formats) if args.pack_formats else None
    loaded.model.set_pack_formats(pack_formats)
    vocab = loaded.hf_config.vocab_size
    warm_len, warm_batch = 32, 2  # the warm-up's prefill length and decode batch (below)
    max_b = max(args.decode_batches + [warm_batch])
    max_len = max(args.prefill_lens + [args.context + args.decode_steps + 1, warm_len])
    ours = _Ours(loaded, num_slots=max_b * max_len, max_batch=max_b, max_len=max_len, backend=args.backend)
    hf = _HF(loaded.hf_dir, torch.float32)
    quant = {}
    for q in args.quantization:  # a separately loaded copy: quantization replaces layers in place
        ql = load_model(args.model, device="cpu", dtype=torch.float32)
        ql.model.set_pack_formats(pack_formats)
        quant[q] = _Ours(
            ql, num_slots=max_b * max_len, max_batch=max_b, max_len=max_len, backend=args.backend, quantization=q
        )
    from radixkv.kernels import cpu as cpu_kernels

    formats = (pack_formats or cpu_kernels.DEFAULT_PACK_FORMATS) if cpu_kernels.AVAILABLE else None
    print(
        f"model {args.model}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"native GEMM weight formats {formats or 'n/a'}"
    )
    print(
        "transformers = its own KV cache loop (DynamicCache, logits_to_keep=1); "
        "generate() = model.generate(do_sample=False), its decode steps timed inside the call"
    )
    print(f"{'measure':<34}{'radixkv':>12}{'transformers':>14}{'ratio':>8}{'generate()':>12}{'ratio':>8}")

    warm = _tokens(warm_len, 1, vocab, 0)
    ours.prefill(warm), hf.prefill(warm)
    for qo in quant.values():
        qo.prefill(warm)
    ours.decode(_tokens(8, warm_batch, vocab, 1), 1)  # builds the packed weights
    packed = loaded.model.packed_weight_bytes()
    if packed:
        print(
            "packed weights for the native GEMM: "
            + ", ".join(f"{f} {b / 1e6:.0f} MB" for f, b in sorted(packed.items()))
        )
    prefill = _prefill_rows(ours, hf, quant, args.prefill_lens, vocab, max(1, args.repeats))
    decode = _decode_rows(ours, hf, quant, args, vocab)
    fields = dict(model=args.model, pack_formats=list(formats) if formats else None, packed_weight_bytes=packed)
    fields.update(prefill=prefill, decode=decode)
    machine = dict(torch=torch.__version__, threads=torch.get_num_threads())
    path = write_result("model_speed", fields, args.out, argv=argv, started=t0, machine=machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
