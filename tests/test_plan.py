"""``radixkv plan``: KV bytes per token from config facts (MHA, GQA, MLA, sliding windows; float32,
bf16/fp16, fp8), checked against the formulas by hand, against radixkv's own KV pool and the
default model's real config.json; what fits after the weights; the 1M-token figures of
docs/explain.md; and the hit rate vs KV memory of a trace."""

from __future__ import annotations

import json
import re

import pytest
import torch

from radixkv.memory.kv_pool import KVPool
from radixkv.obs.architectures import ARCHITECTURES
from radixkv.obs.plan import GB, KVSpec, hit_rate_curve, load_spec, memory_for_hit_rate, plan_memory

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "model,kind,bf16",
    [
        ("llama-2-7b", "MHA", 32 * 32 * 128 * 2 * 2),
        ("llama-3-8b", "GQA", 32 * 8 * 128 * 2 * 2),
        ("llama-3-70b", "GQA", 80 * 8 * 128 * 2 * 2),
        ("mistral-7b", "GQA + sliding window", 32 * 8 * 128 * 2 * 2),
        ("qwen2.5-7b", "GQA", 28 * 4 * 128 * 2 * 2),
        ("deepseek-v3", "MLA", 61 * (512 + 64) * 2),
        ("smollm2-135m", "GQA", 30 * 3 * 64 * 2 * 2),
    ],
)
def test_bytes_per_token_of_the_table(model, kind, bf16):
    s = load_spec(model)
    assert s.attention == kind and ARCHITECTURES[model]["source"].startswith("https://huggingface.co/")
    assert s.bytes_per_token("bfloat16") == s.bytes_per_token("fp16") == bf16
    assert s.bytes_per_token("float32") == 2 * bf16 and s.bytes_per_token("fp8") == bf16 // 2
    assert s.num_parameters and s.weights_bytes("bf16") == 2 * s.num_parameters


def test_the_default_model_agrees_with_its_config_and_the_kv_pool(default_model):
    table = load_spec("smollm2-135m")
    real = load_spec(str(default_model.hf_dir))  # its config.json, parameters estimated from it
    from_obj = KVSpec.from_config(default_model.hf_config)  # a transformers config object
    m = default_model.model
    pool = KVPool.token_bytes(m.num_layers, m.num_kv_heads, m.head_dim, torch.float32)
    assert table.bytes_per_token("float32") == real.bytes_per_token("float32") == from_obj.bytes_per_token("float32")
    assert real.bytes_per_token("float32") == pool
    assert real.num_parameters == table.num_parameters == sum(p.numel() for p in m.parameters())


def test_sliding_windows_and_the_1m_token_figures():
    mistral = load_spec("mistral-7b")
    assert mistral.sequence_bytes(1000, "bf16") == 1000 * 131072
    assert mistral.sequence_bytes(10**6, "bf16") == 32 * 4096 * 8 * 128 * 2 * 2  # every layer keeps 4096
    qwen = load_spec("qwen2.5-7b")  # sliding_window set but use_sliding_window false
    assert qwen.sequence_bytes(10**6, "bf16") == 10**6 * qwen.bytes_per_token("bf16")
    gemma_like = dict(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_size=2304,
        sliding_window=4096, layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    g = KVSpec.from_config(gemma_like, "gemma-like")
    per_layer = 2 * 4 * 256 * 2
    assert g.sequence_bytes(10**5, "bf16") == (2 * 4096 + 2 * 10**5) * per_layer and "sliding" in g.attention
    # docs/explain.md: 1M tokens, MHA in FP16 vs MLA in FP8
    assert load_spec("llama-2-7b").sequence_bytes(10**6, "fp16") / GB == pytest.approx(524.288)
    assert load_spec("llama-3-8b").sequence_bytes(10**6, "fp16") / GB == pytest.approx(131.072)
    assert load_spec("deepseek-v3").sequence_bytes(10**6, "fp8") / GB == pytest.approx(35.136)
    with pytest.raises(ValueError):
        load_spec("gpt-17")
    with pytest.raises(ValueError):
        load_spec("llama-3-8b").bytes_per_token("int3")


def test_sizes_past_a_petabyte_are_refused_naming_the_flag(capsys):
    """`radixkv plan --gpu-memory 1e30` printed a 39-digit token count (and float noise in the KV
    budget's digits): sizes are at most MAX_GB (bytes exact in a float), the error names the flag."""
    from radixkv.cli import main
    from radixkv.obs.plan import MAX_GB

    s = load_spec("llama-3-8b")
    assert MAX_GB * GB < 2**53 and plan_memory(s, gpu_memory_gb=MAX_GB)["fit"]["tokens"] == (
        (int(MAX_GB * GB * 0.9) - 2 * 8_030_261_248) // 131072
    )
    for kw, flag in (("gpu_memory_gb", "--gpu-memory"), ("weights_gb", "--weights-gb")):
        with pytest.raises(ValueError) as e:
            plan_memory(s, **{"gpu_memory_gb": 80, kw: 1e30})
        assert str(e.value) == f"{kw} ({flag}) must be at most 1,000,000 GB (a petabyte), got 1e+30"
    assert main(["plan", "--gpu-memory", "1e30"]) == 2
    assert capsys.readouterr().err.strip() == (
        "radixkv plan: gpu_memory_gb (--gpu-memory) must be at most 1,000,000 GB (a petabyte), got 1e+30"
    )


def test_tokens_that_fit_after_the_weights():
    s = load_spec("llama-3-8b")
    rep = plan_memory(s, "fp8", "bf16", gpu_memory_gb=80, memory_fraction=0.9, context=131072)
    budget = int(80 * GB * 0.9) - 2 * 8_030_261_248
    # radixkv's fp8 pool: 65,536 bytes of fp8 and 1,024 of bfloat16 scales (2 x 32 layers x 8 heads x 2) a token
    assert rep["fit"]["tokens"] == budget // 66560 and rep["fit"]["sequences_of_context"] == budget // (131072 * 66560)
    assert rep["fit"]["formula_tokens"] == budget // 65536
    assert rep["context"]["kv_bytes"] == 131072 * 65536
    rep = plan_memory(s, "bf16", gpu_memory_gb=16, weights_gb=16)  # nothing left
    assert rep["fit"]["tokens"] == 0
    with pytest.raises(ValueError):
        plan_memory(
            KVSpec.from_config(dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=64)), gpu_memory_gb=8
        )
    # sizes must be finite numbers (`--gpu-memory 1e400` is inf: a ValueError, not an OverflowError)
    for kw, field in (({"gpu_memory_gb": float("inf")}, "gpu_memory_gb"), ({"weights_gb": float("inf")}, "weights_gb"),
                      ({"gpu_memory_gb": float("nan")}, "gpu_memory_gb"), ({"weights_gb": float("nan")}, "weights_gb")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            plan_memory(s, "bf16", **{"gpu_memory_gb": 80, **kw})


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_plan_counts_every_byte_of_the_real_pool(default_model, kv_dtype, capsys):
    """What plan says fits in N bytes is what an engine given --kv-cache-memory-bytes N
    allocates, its tensors' bytes counted (fp8's scale tensors included): plan counted no fp8
    scales and promised 868 SmolLM2 tokens in 10 MB where the engine's pool holds 841."""
    from radixkv.cli import main
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    n = 10_000_003
    flags = ["--gpu-memory", str(n / GB), "--weights-gb", "0", "--memory-fraction", "1", "--json"]
    for page_size in (1, 16):
        assert main(["plan", "--kv-dtype", kv_dtype, "--page-size", str(page_size), *flags]) == 0
        rep = json.loads(capsys.readouterr().out)
        cfg = EngineConfig(
            model="smollm2-135m", device="cpu", page_size=page_size, kv_cache_memory_bytes=n, kv_cache_dtype=kv_dtype
        )
        pool = Engine(cfg, loaded_model=default_model).runner.kv_pool
        tensors = pool.k_buffer + pool.v_buffer + (pool.k_scale or []) + (pool.v_scale or [])
        nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
        assert pool.num_slots == rep["fit"]["tokens"]
        assert nbytes == pool.num_slots * rep["engine_kv_bytes_per_token"] <= n
        assert len(tensors) == 30 * (4 if kv_dtype.startswith("fp8") else 2)
    # page 16 (the last one planned): 208 of 217, 432 of 434, 832 of 841
    assert rep["fit"]["tokens"] == {"float32": 208, "bfloat16": 432, "float16": 432}.get(kv_dtype, 832)
    assert main(["plan", "--page-size", "16"]) == 2 and "--page-size needs --gpu-memory" in capsys.readouterr().err
    assert (
        main(["plan", "--page-size", "0", *flags]) == 2 and "page_size must be an int >= 1" in capsys.readouterr().err
    )


def test_hit_rate_vs_memory_and_memory_for_a_target(default_model):
    from radixkv.obs.synthetic import agent_trace
    from radixkv.obs.trace import tokenize_trace
    from radixkv.sim import simulate

    reqs = [r.sim_request() for r in tokenize_trace(agent_trace("control", 16), default_model.tokenizer)]
    s = load_spec("llama-3-8b")
    curve = hit_rate_curve(reqs, s, "bf16", (("radix", 1), ("hash", 16)), points=5)
    rows = curve["curves"]["radix-p1"]
    assert rows[-1]["hit_rate"] == pytest.approx(curve["infinite"]["radix-p1"])
    assert rows[0]["hit_rate"] < rows[-1]["hit_rate"]
    assert all(r["kv_gb"] == pytest.approx(r["tokens"] * 131072 / GB) for r in rows)
    t = memory_for_hit_rate(reqs, s, 0.8, "bf16")
    assert t["reachable"] and t["hit_rate"] >= 0.8
    assert simulate(reqs, "radix", 1, t["tokens"], outcomes=False).hit_rate >= 0.8
    assert simulate(reqs, "radix", 1, int(t["tokens"] * 0.5), outcomes=False).hit_rate < 0.8
    assert not memory_for_hit_rate(reqs, s, 0.999, "bf16")["reachable"]
    # fp8: memory is the pool's (scales included: 66,560 bytes a token, not the formula's 65,536)
    rows = hit_rate_curve(reqs, s, "fp8", (("radix", 1),), points=3)["curves"]["radix-p1"]
    assert all(r["kv_gb"] == pytest.approx(r["tokens"] * 66560 / GB) for r in rows)
    t = memory_for_hit_rate(reqs, s, 0.8, "fp8")
    assert t["kv_gb"] == pytest.approx(t["tokens"] * 66560 / GB)


def test_cli_plan(capsys, tmp_path):
    from radixkv.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80", "--kv-dtype", "fp8", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kv_bytes_per_token"] == 65536 and rep["fit"]["tokens"] > 800_000
    html = tmp_path / "plan.html"
    args = ["plan", "--model", "deepseek-v3", "--kv-dtype", "fp8", "--trace", "synthetic:control:12"]
    assert main(args + ["--target-hit-rate", "0.8", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "35,136 bytes" in out and "hit rate 80.0%" in out
    page = html.read_text()
    assert re.search(r'<img[^>]*src="data:image/png;base64,', page) and "http" not in page.split("<pre>")[0]
    assert main(["plan", "--list"]) == 0 and "DeepSeek-V3" in capsys.readouterr().out
    assert main(["plan", "--model", "nope"]) == 2
    capsys.readouterr()
    for bad, field in (
        ("--gpu-memory=-5", "gpu_memory_gb"),
        ("--context=0", "context"),
        ("--weights-gb=-1", "weights_gb"),
        # finite, but not once in bytes: an OverflowError traceback
        ("--weights-gb=1e300", "weights_gb must be a finite number >= 0 (GB), got 1e+300"),
        ("--gpu-memory=1e300", "gpu_memory_gb must be a finite number > 0 (GB), got 1e+300"),
        ("--weight-dtype=int4", "weight dtype must be one of"),  # it said "kv dtype"
    ):
        assert main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80", bad]) == 2, bad
        assert field in capsys.readouterr().err
    # --kv-dtype takes what serve's --kv-cache-dtype takes: a torch name serve refuses was taken here,
    # and fp8_e4m3 (= fp8) printed the fp8 columns twice
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--list", "--kv-dtype", "float8_e4m3fn"])
    assert exc.value.code == 2 and "--kv-dtype/--kv-cache-dtype: must be one of" in capsys.readouterr().err
    assert main(["plan", "--list", "--kv-dtype", "FP8_E4M3"]) == 0
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head.count("fp8") == 3 and head.count("bfloat16") == 3 and "fp8_e4m3" not in head, head
    # write_back (the host tier's default, asked for by name) beside the default policies' hash row:
    # the error names --policies (it said only that the hash cache refuses write_back)
    trace = ["plan", "--trace", "synthetic:control:4", "--host-cache-bytes", "1GiB"]
    assert main(trace + ["--kv-tier-write-policy", "host=write_back"]) == 2
    assert "pass --policies radix-p1,radix-p16" in capsys.readouterr().err
    assert main(trace + ["--kv-tier-write-policy", "write_back", "--policies", "radix-p1"]) == 0
    capsys.readouterr()
    # a 70B model in bf16 (141 GB of weights) does not fit an 80 GB GPU: said, not "0 tokens" alone
    assert main(["plan", "--model", "llama-3-70b", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "the weights do not fit" in out and "-> 0 tokens" in out


def test_memory_for_a_target_serves_every_request(capsys, tmp_path):
    """Ten repeats of a 50-token prompt and one 2,000-token prompt: a pool below 2,000 tokens
    refuses the long request, and the ten short ones alone hit 88.2%. The memory found for a
    target must hold every request (it answered 50 tokens "reaching 88.2%" for a 15% target, a
    pool the engine refuses the long prompt in); the curve's points below it say how many
    requests they leave out."""
    from radixkv.cli import main
    from radixkv.obs.trace import write_trace
    from radixkv.sim import SimRequest, capacity_needed, simulate

    long, short = list(range(100, 2100)), list(range(5000, 5050))
    reqs = [SimRequest(long)] + [SimRequest(short)] * 10
    assert capacity_needed(reqs) == 2000 and capacity_needed(reqs, 16) == 2000
    assert capacity_needed([SimRequest(short, reply=[1] * 8)], 16) == 64  # 50 + 7 computed, whole pages
    s = load_spec("smollm2-135m")
    t = memory_for_hit_rate(reqs, s, 0.15, "bf16")
    assert t["reachable"] and t["tokens"] >= 2000 and t["hit_rate"] == pytest.approx(9 * 49 / 2500)
    r = simulate(reqs, "radix", 1, t["tokens"], outcomes=False)
    assert r.skipped == 0 and r.cached_tokens == 9 * 49
    assert simulate(reqs, "radix", 1, 1999, outcomes=False).skipped == 1
    t16 = memory_for_hit_rate(reqs, s, 0.15, "bf16", "radix", 16)
    assert t16["tokens"] >= 2000 and t16["tokens"] % 16 == 0
    trace = write_trace(tmp_path / "t.jsonl", [{"prompt": r.tokens} for r in reqs])
    args = ["plan", "--trace", str(trace), "--target-hit-rate", "0.15", "--policies", "radix-p1"]
    assert main(args + ["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    rows = rep["curve"]["curves"]["radix-p1"]
    assert [r["skipped"] for r in rows] == [(r["tokens"] < 2000) + 10 * (r["tokens"] < 50) for r in rows]
    assert rep["target"][0]["tokens"] >= 2000
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "88.2% (1 too large)" in out and "(k too large: k requests do not fit a pool that small" in out
    assert " - (all 11 too large)" in out and " 0.0% (11" not in out  # no hit rate of nothing
    from radixkv.obs.explain import explain_trace
    from radixkv.obs.report import explain_text_report

    rep = explain_trace(reqs, spans=False, sweep=(0.5, 1.0))
    assert [(p["capacity"], p["skipped"]) for p in rep["capacity_curve"]] == [(1025, 1), (2050, 0)]
    assert "50% 88.2% (1 too large)  100% 17.6%" in explain_text_report(rep)


@pytest.mark.parametrize(
    "config, why",
    [
        ({"num_hidden_layers": -2}, "config field num_hidden_layers must be an integer >= 1, got -2"),  # -512 B/token
        ({"num_attention_heads": 0}, "config field num_attention_heads must be an integer >= 1, got 0"),  # ZeroDivision
        ({"num_hidden_layers": 2.5}, "config field num_hidden_layers must be an integer >= 1, got 2.5"),  # taken as 2
        ({"num_hidden_layers": True}, "config field num_hidden_layers must be an integer >= 1, got True"),  # 1 layer
        ({"num_hidden_layers": "2"}, "config field num_hidden_layers must be an integer >= 1, got '2'"),
        ({"sliding_window": -5}, "config field sliding_window must be an integer >= 1, got -5"),  # -2.56 KB of KV
        ({"head_dim": 0}, "config field head_dim must be an integer >= 1, got 0"),  # silently hidden / heads
        (None, "a config must be a JSON object, got list"),  # an AttributeError traceback
    ],
)
def test_cli_plan_refuses_a_config_json_it_cannot_size(config, why, tmp_path, capsys):
    """``radixkv plan --model config.json`` with a field the formulas read out of range or of the
    wrong type: exit 2 naming the field (it printed negative bytes per token, crashed with a
    ZeroDivisionError / AttributeError traceback, or truncated a float)."""
    from radixkv.cli import main

    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps([1, 2] if config is None else {**base, **config, "vocab_size": 100}))
    assert main(["plan", "--model", str(path), "--context", "1000", "--gpu-memory", "8"]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
    path.write_text(json.dumps(base))  # the same config, sound: 2 layers x 2 x 4 heads x 16 x 2 bytes
    assert main(["plan", "--model", str(path), "--kv-dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 512


def test_plan_defaults_to_the_engines_kv_dtype_and_takes_its_pool_options(monkeypatch, capsys):
    """``radixkv plan`` priced K/V in bfloat16 by default where the engine on the CPU stores float32
    (``kv_cache_dtype="auto"``: its compute dtype), so ``plan --trace`` put twice the tokens the
    engine holds into each byte; and it took no pool size in the engine's own terms. Its default is
    now the engine's (bfloat16 on a GPU: with --gpu-memory, or where CUDA is), and it takes
    ``--max-total-tokens`` / ``--kv-cache-memory-bytes`` (one of them, as radixkv serve)."""
    import torch

    from radixkv.cli import main
    from radixkv.models.loader import load_tokenizer
    from radixkv.obs.cli import load_bodies
    from radixkv.obs.trace import tokenize_trace
    from radixkv.sim import simulate

    def plan(*argv):
        assert main(["plan", *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rep = plan()
    assert (rep["kv_dtype"], rep["kv_bytes_per_token"], rep["kv_dtype_auto"]) == ("float32", 46080, True)
    assert plan("--gpu-memory", "8")["kv_dtype"] == "bfloat16"
    assert plan("--kv-dtype", "fp8")["kv_dtype_auto"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plan()["kv_dtype"] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pool = plan("--kv-cache-memory-bytes", "1GiB", "--page-size", "16", "--context", "4096")["pool"]
    assert (pool["tokens"], pool["kv_bytes"], pool["sequences_of_context"]) == (23296, 23296 * 46080, 5)
    assert plan("--max-total-tokens", "3001", "--page-size", "16")["pool"]["tokens"] == 2992
    rep = plan("--trace", "synthetic:control:8", "--max-total-tokens", "1500", "--policies", "radix-p1,radix-p16")
    reqs = [
        r.sim_request() for r in tokenize_trace(load_bodies("synthetic:control:8")[0], load_tokenizer("smollm2-135m"))
    ]
    for label, ps, cap in (("radix-p1", 1, 1500), ("radix-p16", 16, 1488)):
        want = simulate(reqs, "radix", ps, cap, outcomes=False)
        got = rep["pool_hit_rate"][label]
        assert (got["tokens"], got["hit_rate"], got["skipped"]) == (cap, want.hit_rate, want.skipped)
    assert main(["plan", "--max-total-tokens", "100", "--kv-cache-memory-bytes", "1GiB"]) == 2
    assert "give --kv-cache-memory-bytes or --max-total-tokens, not both" in capsys.readouterr().err
    assert main(["plan", "--page-size", "4"]) == 2
    assert "--page-size needs --gpu-memory, --max-total-tokens or --kv-cache-memory-bytes" in capsys.readouterr().err
