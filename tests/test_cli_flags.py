"""`radixkv serve` / `replay` / `plan` refuse a bad or useless flag value before anything starts:
exit 2 with one line naming the flag, never a traceback, never a flag accepted and ignored.
In-process through ``radixkv.cli.main``; every call names a model that does not exist, so a flag
that is not refused fails the test at the model load instead of starting a server."""

from __future__ import annotations

import json

import pytest

from radixkv.cli import main

pytestmark = pytest.mark.timeout(120)


def refused(argv: list, capsys) -> str:
    """The one stderr line ``main(argv)`` exits 2 with (failing if it returns anything else)."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize("port", ["0", "-1", "65536", "70000"])
def test_serve_refuses_a_port_outside_1_to_65535(port, capsys):
    # 70000 used to be bound as 70000 % 65536 = 4464 while the server announced :70000
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", port, "--model", "/nonexistent/model"])
    assert exc.value.code == 2
    assert f"argument --port: must be an integer from 1 to 65535, got {port}" in capsys.readouterr().err


def test_serve_refuses_an_empty_served_model_name(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--served-model-name", " ", "--model", "/nonexistent/model"])
    assert exc.value.code == 2 and "argument --served-model-name: must be a non-empty name" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "replay"])
def test_an_unknown_device_is_named(command, capsys):
    line = refused([command, "--device", "tpu", "--model", "/nonexistent/model"], capsys)
    assert line == f"radixkv {command}: device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"


@pytest.mark.parametrize("command", ["serve", "replay"])
def test_an_unknown_model_is_named(command, tmp_path, capsys):
    line = refused([command, "--model", str(tmp_path / "nope"), "--device", "cpu"], capsys)
    assert line.startswith(f"radixkv {command}: model ") and "not found" in line


@pytest.mark.parametrize("command", ["serve", "replay"])
@pytest.mark.parametrize(
    "flags, why",
    [
        (["--disk-cache-bytes", "1GiB"], "--disk-cache-bytes applies only with --disk-cache-dir"),
        (["--kv-tier-write-policy", "write_back"], "--kv-tier-write-policy needs a KV tier"),
        (["--kv-tier-write-policy", "write_back", "--host-cache-bytes", "0"], "--kv-tier-write-policy needs a KV tier"),
        (["--first-token-preemption"], "--first-token-preemption needs a KV tier"),
    ],
)
def test_tier_flags_without_their_tier_are_refused(command, flags, why, capsys):
    assert refused([command, *flags, "--model", "/nonexistent/model"], capsys).startswith(f"radixkv {command}: {why}")


def test_replay_refuses_write_back_for_the_hash_mode_before_running(capsys):
    """With --modes radix,hash the hash engine refused write_back only after the radix replay ran."""
    flags = ["--modes", "radix,hash", "--host-cache-bytes", "64MiB", "--kv-tier-write-policy", "host=write_back"]
    line = refused(["replay", *flags, "--model", "/nonexistent/model"], capsys)
    assert (
        line
        == "radixkv replay: --kv-tier-write-policy write_back needs the radix cache; --modes hash writes every tier through"
    )


def test_serve_refuses_a_request_log_it_cannot_write_before_loading(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = refused(
        ["serve", "--model", str(tmp_path / "never-loaded"), "--log-requests", str(blocker / "t.jsonl")], capsys
    )
    assert line.startswith(f"radixkv serve: --log-requests {blocker / 't.jsonl'}: cannot append to it: ")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--list", "--json"], "--list prints the architecture table only (with --kv-dtype); not with --json"),
        (
            ["--list", "--model", "llama-3-8b"],
            "--list prints the architecture table only (with --kv-dtype); not with --model",
        ),
        (["--weights-gb", "10"], "--weights-gb needs --gpu-memory"),
        (["--memory-fraction", "0.5"], "--memory-fraction needs --gpu-memory"),
        (["--weight-dtype", "float32"], "--weight-dtype needs --gpu-memory"),
        (["--policies", "radix-p1"], "--policies needs --trace"),
        (["--tokenizer", "smollm2-135m"], "--tokenizer needs --trace"),
        (["--kv-tier-write-policy", "write_back"], "--kv-tier-write-policy needs --trace"),
        (["--target-hit-rate", "0.5"], "--target-hit-rate needs --trace"),
    ],
)
def test_plan_refuses_a_flag_that_would_do_nothing(argv, line, capsys):
    assert refused(["plan", *argv], capsys) == f"radixkv plan: {line}"


def test_plan_defaults_still_apply_when_left_out(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu-memory", "80", "--kv-dtype", "fp8", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    assert (fit["memory_fraction"], fit["weight_dtype"], fit["tokens"]) == (0.9, "bfloat16", 840_436)
    assert main(["plan", "--list", "--kv-dtype", "fp8"]) == 0 and "DeepSeek-V3" in capsys.readouterr().out


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_serve_refuses_disable_prefix_caching_beside_a_prefix_cache(cache, capsys):
    # --prefix-cache hash --disable-prefix-caching used to run without a cache, the hash silently dropped
    line = refused(
        ["serve", "--prefix-cache", cache, "--disable-prefix-caching", "--model", "/nonexistent/model"], capsys
    )
    assert line == f"radixkv serve: --disable-prefix-caching contradicts --prefix-cache {cache}: give one of them"


def test_serve_prefix_cache_flags_reach_the_engine():
    import argparse

    from radixkv.server.cli import add_arguments, engine_kwargs_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    for argv, cache in [([], "radix"), (["--prefix-cache", "hash"], "hash"), (["--disable-prefix-caching"], "none")]:
        assert engine_kwargs_from_args(ap.parse_args(argv))["prefix_cache"] == cache, argv
    assert (
        engine_kwargs_from_args(ap.parse_args(["--prefix-cache", "none", "--disable-prefix-caching"]))["prefix_cache"]
        == "none"
    )


def test_replay_refuses_kv_tiers_when_no_mode_caches(tmp_path, capsys):
    # --modes off --disk-cache-dir D replayed without the tier (the off mode never gets one)
    argv = ["replay", "--modes", "off", "--disk-cache-dir", str(tmp_path), "--model", "/nonexistent/model"]
    line = refused(argv, capsys)
    assert (
        line == "radixkv replay: --disk-cache-dir: KV tiers serve the cached modes (radix, hash); --modes off has none"
    )
    # an empty --disk-cache-dir was skipped by the check and then ignored (no engine gets tiers)
    argv = ["replay", "--modes", "off", "--disk-cache-dir", "", "--model", "/nonexistent/model"]
    assert refused(argv, capsys).startswith("radixkv replay: --disk-cache-dir: KV tiers serve the cached modes")


def test_replay_refuses_a_shared_tier_across_cached_modes(tmp_path, capsys):
    # --modes radix,hash --disk-cache-dir D: hash replayed on the disk tier radix had just filled
    # (99% hit rate against radix's 55% on 3 conversations), a row that was not hash's own
    argv = ["replay", "--modes", "radix,hash,off", "--disk-cache-dir", str(tmp_path), "--model", "/nonexistent/model"]
    line = refused(argv, capsys)
    assert line == (
        "radixkv replay: --disk-cache-dir: with more than one cached mode the later one reads the blocks the "
        "earlier one wrote there (its hit rate would not be its own); replay one cached mode per run"
    )
    argv = ["replay", "--modes", "radix,hash", "--remote-cache-url", "redis://127.0.0.1:1/0", "--model", "/x/y"]
    assert refused(argv, capsys).startswith("radixkv replay: --remote-cache-url: with more than one cached mode")


def test_serve_refuses_a_host_that_does_not_resolve_before_loading(capsys):
    line = refused(["serve", "--host", "no-such-host.invalid", "--model", "/nonexistent/model"], capsys)
    assert line.startswith("radixkv serve: --host no-such-host.invalid: cannot resolve it: ")


@pytest.mark.parametrize("flag, value, low", [("--page-size", "0", 1), ("--top", "-1", 0)])
def test_explain_names_the_one_flag_out_of_range(flag, value, low, capsys):
    # both used to get "--page-size must be >= 1 and --top >= 0"
    assert refused(["explain", "synthetic:control:2", flag, value], capsys) == (
        f"radixkv explain: {flag} must be >= {low}, got {value}"
    )


def test_explain_refuses_kv_tiers_without_a_prefix_cache(capsys):
    # --policy none --disk-cache-tokens N reported "the KV tiers below the pool served 0" where the
    # engine refuses tiers without a prefix cache
    line = refused(["explain", "synthetic:control:2", "--policy", "none", "--disk-cache-tokens", "1000"], capsys)
    assert line == (
        "radixkv explain: KV tiers (--host-, --disk-, --remote-cache-tokens) need a prefix cache: not --policy none"
    )


def test_explain_and_plan_say_a_trace_that_is_a_directory_is_one(tmp_path, capsys):
    # `radixkv explain /etc` said "trace file '/etc' not found"
    line = f"trace {str(tmp_path)!r} is a directory, not a trace file (a JSONL file of request bodies)"
    assert refused(["explain", str(tmp_path)], capsys) == f"radixkv explain: {line}"
    assert refused(["plan", "--trace", str(tmp_path)], capsys) == f"radixkv plan: {line}"
    missing = str(tmp_path / "missing.jsonl")
    assert refused(["explain", missing], capsys) == f"radixkv explain: trace file {missing!r} not found"


def test_serve_checks_the_request_log_as_the_log_creates_it(tmp_path, capsys):
    """The check at start creates the file as the request log does: private (0600), since it
    holds every tenant's prompts (the check's own open left it 0644 for the log to reuse)."""
    log = tmp_path / "new" / "t.jsonl"
    # the model is missing: the run stops after the log check, which created the log
    assert refused(["serve", "--model", str(tmp_path / "nope"), "--log-requests", str(log)], capsys).startswith(
        "radixkv serve: model "
    )
    assert log.exists() and (log.stat().st_mode & 0o777) == 0o600


def test_serve_refuses_a_radix_eviction_policy_without_the_radix_tree(capsys):
    argv = ["serve", "--prefix-cache", "hash", "--radix-eviction-policy", "gdf", "--model", "/nonexistent/model"]
    assert refused(argv, capsys).startswith("radixkv serve: eviction_policy='gdf' applies to prefix_cache='radix' only")


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["explain", "synthetic:control:2", "--disk-cache-tokens", "15", "--no-what-if"],
            "radixkv explain: --disk-cache-tokens 15 holds no block: a KV tier holds whole blocks of 16 tokens; "
            "give at least that (or 0: no tier)",
        ),
        (
            [
                "plan",
                "--trace",
                "synthetic:control:2",
                "--host-cache-bytes",
                "368640",
                "--kv-dtype",
                "bf16",
            ],  # a block's K/V alone
            "radixkv plan: --host-cache-bytes 368,640 holds no block: a KV tier holds whole blocks of 370,564 "
            "bytes (16 tokens x 23,040 bytes of KV and 1,924 of its record); give at least that (or 0: no tier)",
        ),
        (
            ["plan", "--trace", "synthetic:control:2", "--disk-cache-bytes", "370703", "--kv-dtype", "bf16"],
            "radixkv plan: --disk-cache-bytes 370,703 holds no block: a KV tier holds whole blocks of 370,704 "
            "bytes (16 tokens x 23,040 bytes of KV and 2,064 of its record); give at least that (or 0: no tier)",
        ),
    ],
)
def test_explain_and_plan_refuse_a_tier_below_one_block(argv, line, capsys):
    # a tier below one 16-token block holds nothing: explain and plan replayed it and printed the
    # hit rate "with" it, equal to the one without, where radixkv serve refuses such a budget
    assert refused(argv, capsys) == line


def test_plan_takes_a_tier_of_exactly_one_block(capsys):
    argv = [
        "plan",
        "--trace",
        "synthetic:control:2",
        "--policies",
        "radix-p16",
        "--host-cache-bytes",
        "370564",
        "--kv-dtype",
        "bf16",
    ]
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["curve"]["tiers"] == {"host": {"bytes": 370564, "tokens": 16}}


def test_plan_refuses_kv_tiers_without_a_prefix_cache(capsys):
    # --policies none-p1 --host-cache-bytes 1GiB printed the curve without the tiers, exit 0: a
    # flag that did nothing (the engine refuses tiers with prefix_cache='none', explain too)
    argv = ["plan", "--trace", "synthetic:control:2", "--policies", "none-p1", "--host-cache-bytes", "1GiB"]
    assert refused(argv, capsys) == (
        "radixkv plan: KV tiers (--host-, --disk-, --remote-cache-bytes) need a prefix cache: --policies has only none"
    )


def test_serve_max_request_bytes_parses_sizes_and_refuses_less_than_a_byte(capsys):
    import argparse

    from radixkv.server.cli import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    got = [ap.parse_args(a).max_request_bytes for a in ([], ["--max-request-bytes", "1MiB"],
                                                          ["--max-request-bytes", "5000"])]  # fmt: skip
    assert got == [33554432, 1048576, 5000]
    for bad in ("0", "lots"):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--max-request-bytes", bad, "--model", "/nonexistent/model"])
        assert exc.value.code == 2 and "argument --max-request-bytes: --max-request-bytes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--remote-cache-url", "http://x"], "remote_cache_url 'http://x': scheme 'http' is not redis or rediss"),
        (["--disk-cache-dir", "{tmp}", "--disk-cache-bytes", "0"], "disk_cache_bytes must be > 0 when disk_cache_dir"),
        (["--host-cache-bytes", "1MB", "--kv-tier-write-policy", "bogus"], "kv_tier_write_policy: host must be one of"),
        (
            ["--disk-cache-dir", "{tmp}", "--kv-tier-write-policy", "host=write_back"],
            "kv_tier_write_policy names the host",
        ),
    ],
)
def test_replay_refuses_bad_tier_settings_before_loading(flags, why, tmp_path, capsys):
    # these were refused only by the radix mode's engine, after the model load and the warm-up replay
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    line = refused(["replay", *flags, "--model", "/nonexistent/model"], capsys)
    assert line.startswith(f"radixkv replay: {why}"), line


def test_replay_refuses_one_file_for_output_and_the_request_log(tmp_path, capsys):
    # the trace was written, announced ("wrote 4 requests to F"), then overwritten by the rows
    f = str(tmp_path / "x.json")
    line = refused(["replay", "--output", f, "--log-requests", f, "--model", "/nonexistent/model"], capsys)
    assert (
        line
        == f"radixkv replay: --output and --log-requests name the same file {f!r} (the rows would overwrite the trace)"
    )


def test_replay_fails_on_different_replies_only_with_a_float32_pool():
    """The replay's exactness check: modes' greedy replies that differ fail the run (exit 1) with
    float32 K/V; with a bfloat16 / fp8 pool the difference is reported, not a failure (before, a
    bf16 replay exited 1 for what docs/model.md says rounding may do)."""
    from radixkv.replay import identical_verdict

    same, diff = {"radix": [["a"]], "off": [["a"]]}, {"radix": [["a"]], "off": [["b"]]}
    f32, bf16 = [{"kv_cache_dtype": "float32"}] * 2, [{"kv_cache_dtype": "bfloat16"}] * 2
    assert identical_verdict(same, ["radix", "off"], f32) == ("greedy replies identical across modes: yes", True)
    assert identical_verdict(diff, ["radix", "off"], f32) == ("greedy replies identical across modes: NO", False)
    line, ok = identical_verdict(diff, ["radix", "off"], bf16)
    assert ok and line.startswith("greedy replies identical across modes: NO (possible with bfloat16 K/V")
    assert identical_verdict(same, ["radix", "off"], bf16) == ("greedy replies identical across modes: yes", True)
    assert identical_verdict(diff, ["radix"], f32) == ("", True)


@pytest.fixture(scope="module")
def tiny():
    from model_helpers import tiny_loaded_model

    return tiny_loaded_model()


@pytest.fixture
def tiny_replay(tiny, monkeypatch):
    """``main(["replay", ...])`` runs in-process on the tiny random model (its context: 4,096
    tokens) instead of loading the default model."""
    import radixkv.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: tiny)


TINY_REPLAY = [
    "replay",
    "--conversations",
    "2",
    "--turns",
    "2",
    "--max-tokens",
    "2",
    "--device",
    "cpu",
    "--no-progress",
]


def test_replay_refuses_a_page_longer_than_any_sequence(tiny, tiny_replay, capsys):
    # --page-size 5000 over the model's 4,096-token context: no prompt fills a page and only whole
    # pages are cached, so the radix mode ran and cached nothing (0.0%, as off), exit 0
    line = refused([*TINY_REPLAY, "--page-size", "5000"], capsys)
    assert line == (
        "radixkv replay: page_size 5000 is larger than the model's max_position_embeddings 4096, the longest "
        "sequence: no prompt would fill a page and only whole pages are cached; give a page_size of at most 4096"
    )
    from radixkv import LLM

    with pytest.raises(ValueError, match="^page_size 3000 is larger than max_context_len 2048, the longest sequence"):
        LLM(loaded_model=tiny, device="cpu", page_size=3000, max_context_len=2048)


def test_replay_reports_its_retractions(tiny_replay, tmp_path, capsys):
    """A pool of 700 tokens for 4 conversations of 64-token replies: the engine retracts requests
    for KV room; the replay's row and summary say how often (they did not say it at all)."""
    out = tmp_path / "rows.json"
    argv = [*TINY_REPLAY, "--conversations", "4", "--max-tokens", "64", "--max-total-tokens", "700", "--modes", "off"]
    assert main([*argv, "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["retractions"] == 2
    assert row["prefill_tokens"] > row["prompt_tokens"]  # recomputed after retraction (no cache: nothing cached)
    assert "[off] 2 retractions: requests preempted for KV room and resumed" in capsys.readouterr().out


def test_replay_refuses_a_first_prompt_the_engine_cannot_take_before_any_mode_runs(tiny_replay, capsys):
    # the radix mode started and the run stopped at this request with exit 2 (on a long run: hours in)
    assert main([*TINY_REPLAY, "--conversations", "4", "--max-tokens", "64", "--max-total-tokens", "200"]) == 2
    err = capsys.readouterr().err
    assert "[radix] engine:" not in err and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "radixkv replay: conversation 1's first prompt (145 tokens) + --max-tokens 64 exceeds the 200 tokens a "
        "request may take (max_context_len 200, the KV pool's 200 slots): lower --max-tokens or --max-user-chars, "
        "or give a larger --max-total-tokens / --kv-cache-memory-bytes"
    )


@pytest.mark.parametrize("loop", [[], ["--concurrency", "2"]])
def test_replay_ends_a_conversation_whose_history_outgrows_the_engine(loop, tiny_replay, tmp_path, capsys):
    """4 conversations x 3 turns in requests of at most 300 tokens: two histories outgrow it at a
    later turn (their length depends on the replies). Those conversations end there, counted and
    reported, in waves and in a closed loop alike; the replay failed at that request (exit 2)."""
    out = tmp_path / "rows.json"
    argv = [*TINY_REPLAY, "--conversations", "4", "--turns", "3", "--max-tokens", "64", "--max-total-tokens", "300"]
    assert main([*argv, "--modes", "radix", *loop, "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["requests"], row["prompt_tokens"], row["conversations_ended_early"]) == (10, 1370, 2)
    assert (row["max_request_tokens"], row["max_prompt_tokens"]) == (300, 225)  # 225 + 64 <= 300
    assert (
        "[radix] 2 of 4 conversations ended before their last turn: the next prompt + --max-tokens 64 exceeded the "
        "300 tokens a request may take" in capsys.readouterr().out
    )


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    # uvicorn failed to bind only after the model load and the app's startup (exit 3, its log
    # lines); --replicas checked it up front. The engine's settings and the model's path are
    # checked first: a taken port does not hide their errors
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--device", "cpu"]) == 1  # the default model, not loaded
        err = capsys.readouterr().err.strip()
        assert err == f"radixkv serve: --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"
        line = refused(["serve", "--port", str(port), "--device", "tpu"], capsys)
        assert line == "radixkv serve: device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"


def test_serve_refuses_an_unknown_attention_backend_before_loading(capsys):
    # the model runner refused it once the model had loaded; serve, EngineConfig and the
    # backends take the same names
    from radixkv.attention import BACKEND_NAMES
    from radixkv.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKEND_NAMES
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--attention-backend", "triton", "--model", "/nonexistent/model"])
    assert exc.value.code == 2
    assert "argument --attention-backend: invalid choice: 'triton'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, line",
    [
        # radix was replayed twice, two rows named radix (the replies of the second kept)
        (["--modes", "radix,off,radix"], "--modes lists radix more than once, got 'radix,off,radix'"),
        # refused by the dataset reader after the engine's settings, as 'max_user_chars must be >= 1, got 0'
        (["--max-user-chars", "0"], "--max-user-chars must be >= 1"),
    ],
)
def test_replay_names_a_bad_modes_or_max_user_chars_flag(flags, line, capsys):
    assert refused(["replay", *flags, "--model", "/nonexistent/model"], capsys).startswith(f"radixkv replay: {line}")
