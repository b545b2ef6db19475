"""The GPU check's harness logic, on CPU (bench/gpu_check.py, bench/prepare_gpu_carry.py).

No flashinfer and no GPU needed: stable seeds, the greedy near-tie rule, the engine section's
divergence certification and exact prefill count, the timing helpers, the carry verification on
a fake ``.fi``, section caps keeping partial results, and a set-up failure or SIGTERM still
writing ``gpu_check.json`` with ``passed`` false.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check as chk  # noqa: E402
import prepare_gpu_carry as pgc  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(BENCH.parent))


# ----------------------------------------------------------------------------- seeds
def test_stable_seed_is_the_same_in_every_process():
    code = "import sys; sys.path.insert(0, %r); import gpu_check as g; print(g.stable_seed(9, 3, 64, 1, 'prefill'))"
    outs = set()
    for hash_seed in ("1", "2"):
        env = dict(ENV, PYTHONHASHSEED=hash_seed)
        p = subprocess.run([sys.executable, "-c", code % str(BENCH)], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        outs.add(int(p.stdout))
    assert outs == {chk.stable_seed(9, 3, 64, 1, "prefill")}
    assert 0 <= chk.stable_seed("x") < 2**31
    assert chk.stable_seed(1, "prefill") != chk.stable_seed(1, "decode")


# ----------------------------------------------------------------------------- greedy gate
def _run(steps, vocab, base, noise, seed=0):
    """Reference logits per step ([1 prompt, vocab]) and a 'fast' copy with uniform noise."""
    g = torch.Generator().manual_seed(seed)
    ref = [base[s].clone()[None] for s in range(steps)]
    fast = [r + (torch.rand(r.shape, generator=g) * 2 - 1) * noise for r in ref]
    return ref, fast


def _tokens(logits):
    return [[int(step[b].argmax()) for step in logits] for b in range(logits[0].shape[0])]


FP32_EPS = 1.2e-7  # so that the measured noise, not the resolution floor, sets the tolerance


def test_greedy_gate_true_near_tie_passes():
    steps, vocab = 6, 50
    base = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(1)) * 3
    base[:, 7] = base.max(1).values + 1.0  # token 7 wins clearly at every step ...
    base[4, 9] = base[4, 7] - 0.004  # ... except a near tie with token 9 at step 4
    ref, fast = _run(steps, vocab, base, noise=0.01)
    fast[4][0, 9] = fast[4][0, 7] + 0.001  # the fast backend picks the other one of the tie
    res = chk.greedy_gate(_tokens(ref), _tokens(fast), ref, fast, eps=FP32_EPS)
    (entry,) = res["prompts"]
    assert entry["first_divergence"] == 4 and entry["near_tie"] and res["passed"]
    assert 0.005 < res["noise_agreeing_steps"] <= 0.01
    assert entry["ref_margin"] == pytest.approx(0.004, abs=1e-5)
    assert entry["tolerance"] == pytest.approx(2 * res["noise_agreeing_steps"])


def test_greedy_gate_real_divergence_fails_where_the_old_rule_passed():
    steps, vocab = 6, 50
    base = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(2)) * 3
    base[:, 7] = base.max(1).values + 1.0
    base[2, 11] = base[2, 7] - 0.3  # the runner-up, 30x the noise below the winner
    ref, fast = _run(steps, vocab, base, noise=0.01)
    fast[2][0, 11] = ref[2][0, 7] + 0.05  # a wrong kernel lifts it by 0.35
    res = chk.greedy_gate(_tokens(ref), _tokens(fast), ref, fast, eps=FP32_EPS)
    (entry,) = res["prompts"]
    assert entry["first_divergence"] == 2 and entry["fast_token"] == 11
    assert not entry["near_tie"] and not res["passed"]
    # the old rule (top-2 gap <= 2 x the diff at the divergent step, that diff within a quarter
    # of the spread) accepted it: at a first divergence the first inequality always holds
    assert entry["ref_top2_gap"] <= 2 * entry["max_logit_diff_at_step"]
    assert entry["max_logit_diff_at_step"] <= res["max_logit_diff_bound"]


def test_greedy_gate_divergence_at_step_zero_uses_the_resolution_floor():
    vocab = 20
    ref = [torch.zeros(1, vocab)]
    ref[0][0, 3], ref[0][0, 5] = 8.0, 8.0 - 2**-5  # a tie at bf16 resolution (2^-4 at 8.0)
    fast = [ref[0].clone()]
    fast[0][0, 5] = 8.1
    res = chk.greedy_gate(_tokens(ref), _tokens(fast), ref, fast, eps=2**-7)
    (entry,) = res["prompts"]
    assert res["noise_agreeing_steps"] is None  # no agreeing step to measure the noise on
    assert entry["tolerance"] == pytest.approx(2 * 2**-7 * 8.0)
    assert entry["near_tie"] and res["passed"]
    ref[0][0, 5] = 7.6  # a margin of 0.4 is no tie, though the difference stays within the spread bound
    fast[0][0, 5] = 8.05
    res = chk.greedy_gate(_tokens(ref), _tokens(fast), ref, fast, eps=2**-7)
    (entry,) = res["prompts"]
    assert entry["max_logit_diff_at_step"] <= res["max_logit_diff_bound"]
    assert not entry["near_tie"] and not res["passed"]


def test_greedy_gate_equal_runs_pass():
    base = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    ref, fast = _run(4, 30, base, noise=0.0)
    res = chk.greedy_gate(_tokens(ref), _tokens(fast), ref, fast, eps=2**-7)
    assert res["passed"] and res["all_equal"] and res["equal_steps_all_prompts"] == 4


# ----------------------------------------------------------------------------- engine section
def test_certify_divergences_near_tie_and_real_divergence():
    vocab = 40
    full = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    full[:, 1] = 6.0
    full[0, 2] = 6.0 - 0.01  # context 0: a near tie between tokens 1 and 2
    split = full + 0.005
    split[2, 0] += 0.003  # replay noise 0.008 (on a control) -> tolerance 4 x 0.008
    res = chk.certify_divergences(full, split, [(1, 2), (1, 3), None], eps=FP32_EPS)
    assert res["noise"] == pytest.approx(0.008, abs=1e-5)
    (tie, real) = res["divergences"]
    assert tie["near_tie"] and tie["gap"] == pytest.approx(0.01, abs=1e-5)
    assert not real["near_tie"] and not res["passed"]
    assert tie["tolerance"] == pytest.approx(0.032, abs=1e-5)
    assert chk.certify_divergences(full, split, [(1, 2), None, None], eps=FP32_EPS)["passed"]
    # without a control or noise, one bf16 resolution step at the top logit is the floor
    assert chk.certify_divergences(full, full, [(1, 2)], eps=2**-7)["divergences"][0]["tolerance"] == pytest.approx(
        4 * 2**-7 * 6.0
    )


def test_gsp_prompts_first_tokens_are_distinct():
    warm, main, group_of = chk.gsp_prompts(torch, 64, groups=5, per_group=6, system_len=9, question_len=4, seed=1)
    assert len(warm) == 5 and len(main) == 30 and group_of == [g for g in range(5) for _ in range(6)]
    assert len({s[0] for s in warm}) == 5
    for g in range(5):
        qs = [p[9:] for p, o in zip(main, group_of) if o == g]
        assert all(p[:9] == warm[g] for p, o in zip(main, group_of) if o == g)
        assert len({q[0] for q in qs}) == 6
    assert all(3 <= t < 64 for p in main for t in p)
    assert chk.gsp_expected_prefill(5, 6, 9, 4, "radix") == {"warm": 45, "main": 120, "total": 165}
    assert chk.gsp_expected_prefill(5, 6, 9, 4, "none") == {"warm": 45, "main": 390, "total": 435}


def test_random_model_is_radixkvs_random_init(tmp_path):
    """The check's random-weight model is radixkv's own init (``init_random_weights``, drawn on the
    check's device): on the CPU it is ``build_model``'s model, parameter for parameter; a bf16 copy
    holds each draw rounded once."""
    from radixkv.models import build_model, get_model_class, init_random_weights

    c = chk.Check(chk.parse_args(["--cpu", "--out", str(tmp_path)]))
    chk.step_torch(c)
    cfg, lm = chk.random_model(c, chk.TINY, seed=5)
    ref = dict(build_model(cfg, seed=5).named_parameters())
    got = dict(lm.model.named_parameters())
    assert list(got) == list(ref) and len(got) == 2 + 6 * cfg.num_hidden_layers
    for name, p in got.items():
        assert torch.equal(p, ref[name]), name
    assert torch.equal(got["model.norm.weight"], torch.ones(cfg.hidden_size))
    assert float(got["model.embed_tokens.weight"].detach().std()) == pytest.approx(0.02, rel=0.05)
    half = get_model_class(cfg)(cfg).to(torch.bfloat16)
    init_random_weights(half, cfg, seed=5)
    for name, p in half.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref[name].to(torch.bfloat16)), name


def test_engine_prefill_count_is_exact_and_radix_matches_none(tmp_path, request):
    """The formula holds with a budget of 12 tokens a step: radix admits two 5-token questions of
    one group in the same step and chunks the third; none chunks every 25-token prompt."""
    c = chk.Check(chk.parse_args(["--cpu", "--out", str(tmp_path)]))
    chk.step_torch(c)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: one thread avoids barrier waits on a busy machine
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    wl = dict(chk.ENGINE_CPU, groups=2, per_group=3, system_len=20, question_len=5, output_len=3)
    wl.update(chunked_prefill_size=12, max_running_requests=4)
    cfg, lm = chk.random_model(c, chk.TINY, seed=5)
    warm, main, _ = chk.gsp_prompts(torch, cfg.vocab_size, 2, 3, 20, 5, seed=6)
    toks = {}
    for mode in ("radix", "none"):
        run = {}
        exp = chk.gsp_expected_prefill(2, 3, 20, 5, mode)
        toks[mode] = chk.run_gsp(c, lm, wl, mode, warm, main, run, exp)
        assert run["prefill_exact"], (mode, run["prefill_tokens"], exp)
        assert run["evicted_tokens"] == 0 and run["retractions"] == 0 and run["output_len_ok"]
        assert run["ttft_ms"]["p50"] >= 0 and run["output_tok_s"] > 0
    assert toks["radix"] == toks["none"]
    # the comparison: equal tokens pass (the replay only measures noise on controls) ...
    res = {}
    assert chk.compare_engine_tokens(c, lm, wl, warm, main, toks, res)
    assert res["tokens"]["all_equal"] and res["certification"]["divergences"] == []
    assert res["certification"]["contexts"] > 0 and res["certification"]["noise"] < 1e-4
    # ... a tampered "none" run (one warm token, one request from step 1 on) is replayed and fails
    (wn, mn) = toks["none"]
    wn, mn = [(wn[0] + 1) % cfg.vocab_size] + wn[1:], [list(x) for x in mn]
    mn[4][1:] = [(t + 7) % cfg.vocab_size for t in mn[4][1:]]
    res = {}
    assert not chk.compare_engine_tokens(c, lm, wl, warm, main, {"radix": toks["radix"], "none": (wn, mn)}, res)
    assert res["tokens"]["warm_divergent_groups"] == [0] and res["tokens"]["main_first_divergence"] == {"4": 1}
    divs = res["certification"]["divergences"]
    assert len(divs) == 2 and not any(d["near_tie"] for d in divs)
    assert [d["replay_top2"][0] for d in divs] == [toks["radix"][0][0], toks["radix"][1][4][1]]


# ----------------------------------------------------------------------------- timing
def test_median_and_rates_are_never_negative():
    assert chk.median_s([0.3, 0.1, 0.2]) == 0.2
    with pytest.raises(ValueError):
        chk.median_s([0.1, -0.01])
    with pytest.raises(ValueError):
        chk.median_s([])
    assert chk.per_second(10, 0.5) == 20 and chk.per_second(1, 0.0) == float("inf")
    with pytest.raises(ValueError):
        chk.per_second(1, -1.0)
    assert chk.percentile([1, 2, 3, 4], 50) == 2.5 and chk.percentile([5], 99) == 5


def test_step_clock_intervals_are_single_runs():
    clock = chk.StepClock()
    t0 = time.perf_counter()
    for _ in range(4):
        assert clock(None, "scores") == "scores"
    assert len(clock.stamps) == 4
    assert clock.prefill_s(t0) >= 0 and clock.decode_s() >= 0
    assert clock.decode_s() == clock.stamps[-1] - clock.stamps[0]


def test_hf_timed_generate_counts_every_step(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = chk.Check(chk.parse_args(["--cpu", "--out", str(tmp_path)]))
    chk.step_torch(c)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**chk.TINY, bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.randint(3, 512, (2, 7))
    for n in (1, 4):
        prefill_s, decode_s = chk.hf_timed_generate(c, hf, ids, n)
        assert prefill_s > 0 and decode_s >= 0 and (decode_s > 0) == (n > 1)


# ----------------------------------------------------------------------------- carry verification
def _fake_carry(root: Path, modules=(("decode", 64), ("prefill_fa2", 64), ("prefill_fa2", 128)), so_bytes=100):
    fi = root / ".fi"
    (fi / "wheels").mkdir(parents=True)
    recs = []
    whl = fi / "wheels" / "flashinfer_python-0.7.2.post1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("flashinfer/__init__.py", "")
        for kind, hd in modules:
            name = f"{kind}_{hd}"
            z.writestr(f"flashinfer/data/aot/{name}/{name}.so", b"\0" * so_bytes)
            recs.append({"kind": kind, "dtype": "bf16", "head_dim": hd, "name": name, "bytes": so_bytes})
    tvm = fi / "wheels" / "apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl"
    tvm.write_bytes(b"PK")
    wheels = {p.name: p.stat().st_size for p in sorted((fi / "wheels").iterdir())}
    (fi / "manifest.json").write_text(json.dumps({"wheels": wheels, "aot_modules": recs}))
    return fi


def test_verify_carry_on_a_fake_fi(tmp_path):
    fi = _fake_carry(tmp_path / "ok")
    res = pgc.verify_carry(fi, tree_bytes=1000)
    assert res["ok"], res["problems"]
    assert res["modules"] == ["decode:64:bf16", "prefill:64:bf16", "prefill:128:bf16"]
    assert res["total_bytes"] == res["fi_bytes"] + 1000
    # over the limit
    res = pgc.verify_carry(fi, tree_bytes=1000, limit_bytes=res["fi_bytes"] + 500)
    assert not res["ok"] and "MiB" in res["problems"][0]
    # a required module missing from the manifest
    fi2 = _fake_carry(tmp_path / "missing", modules=(("decode", 64), ("prefill_fa2", 64)))
    res = pgc.verify_carry(fi2)
    assert not res["ok"] and any("prefill module for head_dim 128" in p for p in res["problems"])
    # a module listed in the manifest but absent from the wheel
    man = json.loads((fi2 / "manifest.json").read_text())
    man["aot_modules"].append({"kind": "prefill_fa2", "dtype": "bf16", "head_dim": 128, "name": "gone"})
    (fi2 / "manifest.json").write_text(json.dumps(man))
    res = pgc.verify_carry(fi2)
    assert any("lacks flashinfer/data/aot/gone/gone.so" in p for p in res["problems"])
    # a wheel whose size differs from the manifest, and no .fi at all
    (fi / "wheels" / "apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"PK..")
    assert any("in the manifest" in p for p in pgc.verify_carry(fi)["problems"])
    res = pgc.verify_carry(tmp_path / "nothing")
    assert not res["ok"] and "does not exist" in res["problems"][0]


def test_prepare_check_only_exit_status(tmp_path):
    fi = _fake_carry(tmp_path)
    script = str(BENCH / "prepare_gpu_carry.py")
    p = subprocess.run([sys.executable, script, "--check-only", "--out", str(fi)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "carry check: OK" in p.stdout
    p = subprocess.run(
        [sys.executable, script, "--check-only", "--out", str(fi), "--limit-mib", "0.001"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "CARRY CHECK FAILED" in p.stderr


# ----------------------------------------------------------------------------- budget, caps, JSON
def test_section_cap_keeps_partial_results_and_saves(tmp_path, monkeypatch):
    def slow_gate(c, res):
        res["cases"] = []
        for i in range(3):
            res["cases"].append(i)
        time.sleep(60)
        return True

    def slow_figures(c, res):
        res["rows"] = ["one"]
        time.sleep(60)
        return True

    monkeypatch.setitem(chk.SECTION_FNS, "attention", slow_gate)
    monkeypatch.setitem(chk.SECTION_FNS, "speed", slow_figures)
    monkeypatch.setitem(chk.SECTION_FNS, "bandwidth", lambda c, res: True)
    c = chk.Check(
        chk.parse_args(
            ["--cpu", "--out", str(tmp_path), "--cap", "attention=0.3", "--cap", "speed=0.3", "--budget", "60"]
        )
    )
    c.res["setup"]["ok"] = True
    old = signal.signal(signal.SIGALRM, chk._on_alarm)
    try:
        t = time.time()
        chk.run_sections(c, ["attention", "speed", "bandwidth"])
        # both 60 s sections were cut at their 0.3 s caps (generous bound: a loaded machine
        # delays the alarm and the JSON writes, but uncut sections would take 120 s)
        assert time.time() - t < 60
    finally:
        signal.signal(signal.SIGALRM, old)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    att, spd = saved["sections"]["attention"], saved["sections"]["speed"]
    assert att["timed_out"] and att["cases"] == [0, 1, 2] and att["passed"] is False
    assert spd["timed_out"] and spd["rows"] == ["one"] and saved["incomplete"] == ["speed"]
    assert saved["sections"]["bandwidth"]["passed"] is True
    assert chk.overall_passed(c.res) is False  # the gating section timed out
    c.res["sections"]["attention"] = {"passed": True}
    assert chk.overall_passed(c.res) is True  # a figures section cut short is only incomplete
    c.res["pytest"] = {"passed": False}
    assert chk.overall_passed(c.res) is False


def test_setup_failure_still_writes_json(tmp_path):
    """GPU mode on this CPU machine with an empty carry: the carry steps fail, sections are
    skipped, and the JSON (plus the table) says so with passed false and exit status 1."""
    empty = tmp_path / "empty_fi"
    empty.mkdir()
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--carry", str(empty), "--out", str(out), "--budget", "30"],
        env=dict(ENV, RADIXKV_FI_SITE=str(tmp_path / "site"), FLASHINFER_WORKSPACE_BASE=str(tmp_path / "ws")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["passed"] is False and res["setup"]["ok"] is False
    assert res["setup"]["fatal"] == "carry_install"
    steps = res["setup"]["steps"]
    assert not steps["carry_verify"]["ok"] and "manifest.json is missing" in steps["carry_verify"]["problems"][0]
    assert "FileNotFoundError" in steps["carry_install"]["error"] and "Traceback" in steps["carry_install"]["traceback"]
    assert not steps["cuda"]["ok"] and "cuda" in steps["cuda"]["error"]  # still looked at
    assert steps["env"]["env"]["FLASHINFER_DISABLE_JIT"] == "1"
    assert steps["env"]["env"]["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "ws")
    assert "which" in steps["toolchain"] and "cuda_layout" in steps["toolchain"]
    assert all("skipped" in s and s["passed"] is False for s in res["sections"].values())
    assert "carry_install" in (out / "gpu_check.md").read_text()
    # the pytest merge keeps the failure and records pytest (a log with skips fails in gpu mode)
    log = tmp_path / "pytest.log"
    log.write_text("....ss\n4 passed, 2 skipped in 1.0s\n")
    m = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--merge-pytest", str(log), "--pytest-rc", "0"]
        + ["--check-rc", "1", "--out", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert m.returncode == 1
    merged = json.loads((out / "gpu_check.json").read_text())
    assert merged["pytest"]["passed"] is False and merged["pytest"]["skipped"] == 2 and merged["passed"] is False


def test_merge_pytest_passes_only_when_both_pass(tmp_path):
    (tmp_path / "gpu_check.json").write_text(json.dumps({"passed": True, "mode": "gpu"}))
    log = tmp_path / "pytest.log"
    log.write_text("..........\n==== 18 passed in 3.2s ====\n")
    args = ["--merge-pytest", str(log), "--out", str(tmp_path), "--check-rc", "0"]
    assert chk.main(args + ["--pytest-rc", "0"]) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["passed"] and res["pytest"]["passed"] and res["pytest"]["rc"] == 0
    assert chk.main(args + ["--pytest-rc", "1"]) == 1  # check_passed is kept from the first merge
    assert json.loads((tmp_path / "gpu_check.json").read_text())["check_passed"] is True
    # no JSON at all (the check died before writing): the merge still writes one, failed
    empty = tmp_path / "none"
    assert chk.main(["--merge-pytest", str(log), "--pytest-rc", "0", "--out", str(empty)]) == 1
    assert "unreadable" in json.loads((empty / "gpu_check.json").read_text())["error"]


def test_sigterm_still_writes_json(tmp_path):
    """SIGTERM (what ``timeout`` sends) during the run: the JSON says so, passed false, exit 1."""
    out = tmp_path / "out"
    p = subprocess.Popen(
        [sys.executable, str(BENCH / "gpu_check.py"), "--cpu", "--out", str(out)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (out / "gpu_check.json").exists():
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 1
    finally:
        if p.poll() is None:
            p.kill()
    res = json.loads((out / "gpu_check.json").read_text())
    assert "SIGTERM" in res["terminated"] and res["passed"] is False
    assert "terminated" in (out / "gpu_check.md").read_text()
