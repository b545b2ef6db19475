"""SGLang's native API (``/generate``, ``/get_model_info``, ``/server_info``, ``/health_generate``,
``/flush_cache?timeout=``) and vLLM's extras (``/reset_prefix_cache``, ``/version``,
``/tokenize``, ``/detokenize``) on the real engine (default model, CPU), over HTTP with httpx;
and the replay of SGLang's frontend traffic recorded in tests/fixtures/sglang_frontend/.

One server for the module; ``max_new_tokens`` stays small.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import httpx
import pytest
import torch

import radixkv

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_helpers import assert_pool_whole  # noqa: E402

from radixkv.chat_template import encode_chat  # noqa: E402
from radixkv.server.sglang.protocol import field_names  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
FIXTURES = Path(__file__).parent / "fixtures" / "sglang_frontend"
PROMPT = "A short list of things to pack for a beach day:"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


def ids_of(llm, text: str) -> list[int]:
    return list(llm.tokenizer.encode(text, add_special_tokens=False))


def flush(http) -> None:
    assert http.post("/flush_cache").status_code == 200


def sse_events(resp: httpx.Response) -> list:
    """The ``data:`` payloads of an event stream (JSON, or the raw ``[DONE]``)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# ---------------------------------------------------------------------------------- /generate


def test_generate_greedy_matches_transformers_and_reports_the_cache(http, llm, hf_default):
    flush(http)
    ids = ids_of(llm, PROMPT)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    first = http.post("/generate", json=body).json()
    with torch.no_grad():
        ref = hf_default.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=6, pad_token_id=llm.tokenizer.eos_token_id,
        )[0, len(ids):].tolist()  # fmt: skip
    assert first["output_ids"] == ref
    assert first["text"] == llm.tokenizer.decode(ref, skip_special_tokens=True)
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6
    assert meta["cached_tokens"] == 0  # cold after the flush
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert isinstance(meta["id"], str) and meta["e2e_latency"] > 0
    # the same prompt again: every prompt token but the last comes from the cache (page_size 1)
    again = http.post("/generate", json={**body, "rid": "beach-2"}).json()
    assert again["output_ids"] == ref and again["meta_info"]["id"] == "beach-2"
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    # the same request through input_ids
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": body["sampling_params"]}).json()
    assert by_ids["output_ids"] == ref and by_ids["text"] == first["text"]
    assert_pool_whole(llm)


def test_generate_batch_n_and_per_prompt_params(http, llm):
    texts = [PROMPT, "Three colors of the rainbow are"]
    sp = {"max_new_tokens": 5, "temperature": 0.8, "sampling_seed": 7, "n": 2}
    out = http.post("/generate", json={"text": texts, "sampling_params": sp, "rid": ["a", "b"]}).json()
    assert isinstance(out, list) and len(out) == 4  # prompt-major, then sample
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b-0", "b-1"]
    for k, o in enumerate(out):
        assert o["meta_info"]["prompt_tokens"] == len(ids_of(llm, texts[k // 2]))
        assert o["meta_info"]["completion_tokens"] == len(o["output_ids"]) <= 5
    again = http.post("/generate", json={"text": texts, "sampling_params": sp}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]  # the seed decides
    # one sampling_params per prompt; a single prompt with n = 1 is one object, not a list
    per = [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 3, "temperature": 0}]
    two = http.post("/generate", json={"text": texts, "sampling_params": per}).json()
    assert [o["meta_info"]["completion_tokens"] for o in two] == [2, 3]
    one = http.post("/generate", json={"text": texts[1], "sampling_params": per[1]}).json()
    assert isinstance(one, dict) and one["output_ids"] == two[1]["output_ids"]
    assert_pool_whole(llm)


def test_zero_new_tokens_prefills_and_caches_the_prefix(http, llm):
    flush(http)
    prefix = ids_of(llm, "You are a concise assistant. Answer each question in one line.")
    zero = http.post("/generate", json={"input_ids": prefix, "sampling_params": {"max_new_tokens": 0}}).json()
    assert zero["text"] == "" and zero["output_ids"] == []
    meta = zero["meta_info"]
    assert meta["completion_tokens"] == 0 and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(prefix) and meta["cached_tokens"] == 0
    follow = prefix + ids_of(llm, " What is two plus two?")
    r = http.post("/generate", json={"input_ids": follow, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.json()["meta_info"]["cached_tokens"] == len(prefix)  # the whole prefilled prefix was kept
    assert_pool_whole(llm)


def test_cache_salt_and_extra_key_are_separate_namespaces(http, llm):
    """``cache_salt`` / ``extra_key`` are fields of one Namespace: requests share cached prefixes
    only with the same salt and key; an empty ``extra_key`` is none (the shared default), an empty
    ``cache_salt`` a 400."""
    flush(http)
    ids = ids_of(llm, PROMPT)

    def cached(**fields) -> int:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **fields}
        r = http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached(cache_salt="s1") == 0
    assert cached(cache_salt="s1") == len(ids) - 1
    assert cached(cache_salt="s2") == 0
    assert cached() == 0
    assert cached(extra_key="s1") == 0  # a key is not a salt
    assert cached(cache_salt="s1", extra_key="k") == 0
    assert cached(extra_key="") == len(ids) - 1  # the default, cached by cached() above
    # radixkv's cache_salt rule (issue 37): "" is no salt but a 400 naming the field
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "cache_salt": ""}
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    # extra_key is bounded as cache_salt is (each namespace a cache holds keeps its key: 60
    # requests with 4 MB keys held 450 MiB more of the server's memory until evicted)
    assert cached(extra_key="k" * 128) == 0
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "extra_key": "k" * 129}
    err = error_of(http.post("/generate", json=body))
    assert (err["param"], err["code"]) == ("extra_key", "invalid_value")
    assert err["message"] == "extra_key must be a string of at most 128 characters, got 129 characters"


def test_stream_is_sglang_sse_with_cumulative_text(http, llm):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    plain = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("index" not in c for c in chunks)  # one prompt, n = 1
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["text"] == plain["text"] and last["output_ids"] == plain["output_ids"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert last["meta_info"]["completion_tokens"] == plain["meta_info"]["completion_tokens"]
    # a streamed batch tags each event with its answer's index; stream_interval thins the events
    batch = {"text": [PROMPT, "Water boils at"], "stream": True,
             "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stream_interval": 3}}  # fmt: skip
    with http.stream("POST", "/generate", json=batch) as resp:
        events = sse_events(resp)[:-1]
    assert sorted({e["index"] for e in events}) == [0, 1]
    for i in (0, 1):
        counts = [e["meta_info"]["completion_tokens"] for e in events if e["index"] == i]
        # SGLang sends the first token at once, then every stream_interval tokens, and the finish
        # (radixkv sent [3, 6]: the first text only after stream_interval tokens, a later TTFT)
        assert counts == [1, 4, 6], counts
    assert_pool_whole(llm)


def test_stop_strings_are_trimmed_unless_no_stop_trim(http, llm):
    base = {"text": "Count: one, two, three, four, five,", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    free = http.post("/generate", json=base).json()["text"]
    stop = free.strip().split()[1]  # a word the greedy answer reaches
    sp = {**base["sampling_params"], "stop": [stop]}
    trimmed = http.post("/generate", json={**base, "sampling_params": sp}).json()
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in trimmed["text"] and free.startswith(trimmed["text"])
    kept = http.post("/generate", json={**base, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["text"] == trimmed["text"] + stop
    # EOS is SGLang's {"type": "stop", "matched": <eos id>}
    chat = encode_chat(llm.tokenizer, [{"role": "user", "content": "Say hi."}])
    eos = http.post("/generate", json={"input_ids": chat, "sampling_params": {"max_new_tokens": 64, "temperature": 0}})
    reason = eos.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in llm.engine.eos_token_ids
    assert_pool_whole(llm)


def test_no_stop_trim_keeps_the_whole_last_token_after_a_stop_string(http, llm):
    """A stop string matched inside a token: SGLang trims at the string, but with
    ``no_stop_trim`` nothing is trimmed (the text is the decoded output_ids). radixkv cut the
    text right after the stop string, so the rest of that token was lost."""
    base = {"text": "Count: one, two, three, four, five,", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    free = http.post("/generate", json=base).json()
    pieces = [llm.tokenizer.decode([t]) for t in free["output_ids"]]
    k = next(i for i, t in enumerate(pieces) if len(t.strip()) >= 3 and t.strip()[:2] not in "".join(pieces[:i]))
    stop = pieces[k].strip()[:2]  # the start of a token the greedy answer reaches
    sp = {**base["sampling_params"], "stop": stop}
    trimmed = http.post("/generate", json={**base, "sampling_params": sp}).json()
    assert trimmed["text"] == "".join(pieces)[: "".join(pieces).index(stop)]
    kept = http.post("/generate", json={**base, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["output_ids"] == free["output_ids"][: k + 1]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == llm.tokenizer.decode(free["output_ids"][: k + 1]) == "".join(pieces[: k + 1])
    assert_pool_whole(llm)


def test_json_schema_any_is_sglangs_any_json(http, llm):
    """``json_schema: "$$ANY$$"`` is SGLang's marker for xgrammar's built-in JSON grammar (any
    object or array; SGLang's bench scripts send it): the answer is the greedy sample under that
    grammar, token for token the answer with that grammar as ``ebnf`` (and not the free one); it
    was a 400 "not valid JSON"."""
    from radixkv.sampling.grammar import any_json_ebnf

    body = {"text": "List three colours as JSON:", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    body["sampling_params"]["json_schema"] = "$$ANY$$"
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    sp = {k: v for k, v in body["sampling_params"].items() if k != "json_schema"}
    want = http.post("/generate", json={**body, "sampling_params": {**sp, "ebnf": any_json_ebnf()}}).json()
    free = http.post("/generate", json={**body, "sampling_params": sp}).json()
    assert out["output_ids"] == want["output_ids"] != free["output_ids"] and out["text"][:1] in "{["
    both = {**body["sampling_params"], "regex": "a+"}
    assert error_of(http.post("/generate", json={**body, "sampling_params": both}))["param"] is not None
    assert_pool_whole(llm)


def test_every_sglang_field_is_accepted_at_its_default():
    """The /generate fields of SGLang 0.5.23's GenerateReqInput (its dataclass, listed here) are
    all known to radixkv."""
    sglang_fields = set(
        """rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes
        mm_content_hashes use_audio_in_video video_config sampling_params watermark return_logprob
        logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask sampling_logprobs_mode
        return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs
        return_flat_raw_top_logprobs_b64 stream log_metrics return_hidden_states return_routed_experts
        routed_experts_start_len return_indexer_topk modalities session_params lora_path lora_id
        custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room
        bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank
        routing_key conversation_id http_worker_ipc background require_reasoning max_thinking_tokens
        priority extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids
        external_trace_header received_time need_wait_for_mm_inputs num_items_assigned encoder_urls
        max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config
        mm_processor_kwargs multi_item_delimiter_indices token_indices_to_pool cache_salt kv_hints""".split()
    )
    assert sglang_fields == field_names()


def test_bad_generate_requests_get_400_naming_the_field(http, llm):
    cases = [
        ({"text": "hi", "foo": 1}, "foo", "unknown_parameter"),
        ({"text": "hi", "lora_path": "adapter"}, "lora_path", "unsupported_parameter"),
        ({"text": "hi", "sampling_params": {"temperature": "1"}}, "sampling_params.temperature", "invalid_value"),
        ({"text": "hi", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens", "unknown_parameter"),
        ({"text": "hi", "input_ids": [1, 2]}, "input_ids", "invalid_value"),
        ({"sampling_params": {}}, "text", "invalid_value"),
        ({"text": ""}, "text", "invalid_value"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens",
         "context_length_exceeded"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", "invalid_value"),
        ({"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k", "invalid_value"),
        ({"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "invalid_value"),
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "invalid_value"),
        ({"text": "hi", "sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex",
         "unsupported_parameter"),
        ({"text": "hi", "token_ids_logprob": [1]}, "token_ids_logprob", "unsupported_parameter"),
        ({"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num", "invalid_value"),
        ({"text": "hi", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num", "invalid_value"),
        # logprob options without return_logprob asked for logprobs: they were dropped without a word
        ({"text": "hi", "top_logprobs_num": 2}, "top_logprobs_num", "invalid_value"),
        ({"text": "hi", "logprob_start_len": 0}, "logprob_start_len", "invalid_value"),
        ({"text": "hi", "return_text_in_logprobs": True}, "return_text_in_logprobs", "invalid_value"),
        ({"text": ["a", "b"], "return_logprob": [True, False], "top_logprobs_num": [1, 3]}, "top_logprobs_num",
         "invalid_value"),
        ({"text": "hi", "sampling_params": {"stream_interval": 4}}, "sampling_params.stream_interval", "invalid_value"),
        ({"text": ["a", "b"], "rid": "one"}, "rid", "invalid_value"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "invalid_value"),
        ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params.n", "invalid_value"),
        ({"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1}]}, "sampling_params[1].temperature",
         "invalid_value"),
        ({"text": ["a", "b"], "sampling_params": [{"stop_regex": "x"}, {}]}, "sampling_params[0].stop_regex",
         "unsupported_parameter"),
        ({"input_ids": [10**7]}, "input_ids", "invalid_value"),
    ]  # fmt: skip
    for body, param, code in cases:
        err = error_of(http.post("/generate", json=body))
        assert (err["param"], err["code"]) == (param, code), (body, err)
    assert error_of(http.post("/generate", content=b"{not json"))["code"] == "invalid_json"
    deep = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # the stdlib parser's recursion limit
    surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'  # json.loads takes it, pydantic not
    for route, body in [(r, deep) for r in ("/generate", "/v1/chat/completions", "/v1/responses", "/tokenize")] + [
        ("/v1/chat/completions", surrogate)
    ]:
        err = error_of(http.post(route, content=body, headers={"content-type": "application/json"}))
        assert err["code"] == "invalid_json" and "not valid JSON" in err["message"], (route, err)
    part = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bar": 1}]}]}
    err = error_of(http.post("/v1/chat/completions", json=part))
    assert (err["param"], err["code"]) == ("messages", "unknown_parameter") and "messages.0.content.0.bar" in err[
        "message"
    ]
    ok = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200  # still serving
    inert = {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False}
    ok = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}, **inert})
    assert ok.status_code == 200 and "output_token_logprobs" not in ok.json()["meta_info"]  # bench_serving's
    # an assistant message as the openai SDK dumps a response's (annotations and all) is a message;
    # annotations on another role are named
    said = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None}
    said |= {"function_call": None, "tool_calls": None}
    turn = [{"role": "user", "content": "hello"}, said, {"role": "user", "content": "again"}]
    plain = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}, turn[2]]
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    got = [http.post("/v1/chat/completions", json=body | {"messages": m}).json() for m in (turn, plain)]
    assert got[0]["choices"][0]["message"] == got[1]["choices"][0]["message"]
    assert got[0]["usage"]["prompt_tokens"] == got[1]["usage"]["prompt_tokens"]
    bad = [{"role": "user", "content": "x", "annotations": [{"type": "url_citation"}]}]
    err = error_of(http.post("/v1/chat/completions", json=body | {"messages": bad}))
    assert err["param"] == "messages" and "annotations" in err["message"], err
    assert_pool_whole(llm)


def test_one_logprob_option_for_a_batch_serves_the_prompts_that_ask_for_logprobs(http, llm):
    """``top_logprobs_num`` / ``logprob_start_len`` given once for a batch whose ``return_logprob``
    is a list apply to the prompts that ask (SGLang's per-prompt broadcast); they were refused as
    if the prompts without logprobs had asked for them."""
    sampling = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    body = {"text": ["a", "b"], "return_logprob": [True, False], "sampling_params": sampling}
    r = http.post("/generate", json=body | {"top_logprobs_num": 2, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    first, second = (item["meta_info"] for item in r.json())
    assert len(first["output_top_logprobs"]) == first["completion_tokens"] == 2
    assert all(len(top) == 2 for top in first["output_top_logprobs"])
    assert len(first["input_token_logprobs"]) == first["prompt_tokens"]  # from position 0
    assert "output_token_logprobs" not in second and "output_top_logprobs" not in second
    # with no prompt asking, the one value asks for logprobs nobody gets: still a 400 naming it
    body["return_logprob"] = [False, False]
    err = error_of(http.post("/generate", json=body | {"top_logprobs_num": 2}))
    assert (err["param"], err["code"]) == ("top_logprobs_num", "invalid_value"), err
    assert_pool_whole(llm)


# ---------------------------------------------------------------------------------- info, health, flush


def test_model_info_server_info_and_health(http, llm):
    info = http.get("/get_model_info").json()
    assert info == http.get("/model_info").json()
    assert info["model_path"] == MODEL and info["served_model_name"] == MODEL and info["is_generation"] is True
    assert Path(info["tokenizer_path"], "tokenizer_config.json").is_file()  # a local tokenizer directory
    assert info["max_context_len"] == llm.max_context_len
    si = http.get("/server_info").json()
    assert si.keys() == http.get("/get_server_info").json().keys()
    assert si["page_size"] == 1 and si["max_total_num_tokens"] == 16384 and si["disable_radix_cache"] is False
    assert si["context_length"] == llm.max_context_len and si["version"]
    stats = si["internal_states"][0]
    assert stats["capacity"] == 16384 and {"hit_rate", "cached_tokens", "prompt_tokens"} <= stats.keys()
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert_pool_whole(llm)


def test_flush_waits_with_timeout_and_reset_prefix_cache_is_409_while_busy(http, server, llm):
    http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    body = {"text": "Count from one to one hundred:", "stream": True,
            "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    result: dict = {}
    with httpx.Client(base_url=server.base_url, timeout=300) as other:
        with other.stream("POST", "/generate", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it runs now
            err = error_of(http.post("/reset_prefix_cache"), 409)
            assert err["code"] == "requests_running"
            assert error_of(http.get("/flush_cache"), 409)["code"] == "requests_running"

            # with a timeout the flush waits for the request to finish, then flushes
            def flush_with_timeout():
                with httpx.Client(base_url=server.base_url, timeout=300) as c:
                    result["r"] = c.post("/flush_cache", params={"timeout": 120})

            t = threading.Thread(target=flush_with_timeout)
            t.start()
            rest = [line for line in lines if line.startswith("data:")]
            t.join(120)
    assert rest[-1] == "data: [DONE]" and '"length": 60' in rest[-2]
    assert result["r"].status_code == 200 and result["r"].json()["flushed"] is True
    stats = assert_pool_whole(llm)
    assert stats["evictable"] == 0  # flushed after the request finished
    assert error_of(http.post("/reset_prefix_cache", params={"reset_running_requests": "true"}))["param"] == (
        "reset_running_requests"
    )
    assert error_of(http.post("/flush_cache", params={"timeout": "soon"}))["param"] == "timeout"
    assert http.post("/reset_prefix_cache", params={"reset_external": "true"}).json()["flushed"] is True
    # no KV tier here: ?tiers=true said "the prefix cache and the KV tiers it owns were flushed"
    assert http.post("/flush_cache", params={"tiers": "true"}).json() == {
        "flushed": True,
        "message": "the prefix cache was flushed (no host or disk tier to flush)",
    }


def test_admin_routes_refuse_unknown_and_malformed_query_parameters(http, llm):
    """``/flush_cache?tier=true`` (a typo of ``tiers``) flushed the pool only and said nothing, and
    ``/cache_stats?check=yes`` ran no check: every query parameter is one the route takes, with a
    boolean read the same way on every route, else a 400 naming it."""
    for path, params, method in [
        ("/flush_cache", {"tier": "true"}, http.post),
        ("/cache_stats", {"chek": "1"}, http.get),
        ("/reset_prefix_cache", {"reset_all": "true"}, http.post),
    ]:
        err = error_of(method(path, params=params))
        assert (err["param"], err["code"]) == (next(iter(params)), "unknown_parameter"), path
    assert error_of(http.get("/cache_stats", params={"check": "maybe"}))["param"] == "check"
    assert http.get("/cache_stats", params={"check": "yes"}).status_code == 200
    assert http.post("/flush_cache", params={"tiers": "no", "timeout": "1"}).json()["flushed"] is True


# ---------------------------------------------------------------------------------- vLLM extras


def test_completions_report_cached_tokens_as_sglext(http, llm):
    """SGLang's ``return_cached_tokens_details`` on /v1/completions (what ``bench_serving --backend
    vllm --cache-report`` reads): the prompt's cached tokens, equal to usage's."""
    flush(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_cached_tokens_details": True}
    first = http.post("/v1/completions", json=body).json()
    assert first["sglext"] == {"cached_tokens_details": {"device": 0, "host": 0}}
    n = len(ids_of(llm, PROMPT))
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        events = sse_events(r)
    finishing = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0]["sglext"] == {"cached_tokens_details": {"device": n - 1, "host": 0}}
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert all("sglext" not in e for e in events[:-1] if e is not finishing[0])
    assert "sglext" not in http.post("/v1/completions", json={**body, "return_cached_tokens_details": False}).json()


def test_tokenize_detokenize_version(http, llm):
    tok = llm.tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT, add_special_tokens=True) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.max_context_len
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = http.post("/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == encode_chat(tok, msgs) and chat["token_strs"] is None
    no_gen = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == encode_chat(tok, msgs, add_generation_prompt=False)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    assert http.get("/version").json() == {"version": radixkv.__version__}
    assert error_of(http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404)["code"] == "model_not_found"
    assert error_of(http.post("/tokenize", json={"prompt": "x", "messages": msgs}))["param"] == "prompt"
    assert error_of(http.post("/tokenize", json={"prompt": "x", "extra": 1}))["code"] == "unknown_parameter"
    tools = [{"type": "function", "function": {"name": "f"}}]  # the chat form's: a prompt's count dropped them
    assert error_of(http.post("/tokenize", json={"prompt": "x", "tools": tools}))["param"] == "tools"
    assert error_of(http.post("/detokenize", json={"tokens": [-1]}))["param"] == "tokens"
    assert error_of(http.post("/detokenize", json={"tokens": ["a"]}))["param"] == "tokens"


# ---------------------------------------------------------------------------------- SGLang frontend replay


def _same_shape(recorded, replayed, where="") -> None:
    """The replayed JSON has the recorded one's structure: the same keys, the same JSON types
    (numbers compare as numbers, null matches anything nullable). radixkv's own sections of
    ``/server_info`` (its config and cache stats) may have grown since the recording."""
    if recorded is None or replayed is None:
        return
    if isinstance(recorded, dict):
        assert isinstance(replayed, dict), where
        if where.endswith((".radixkv_config", ".internal_states[]")):
            assert recorded.keys() <= replayed.keys(), where
        else:
            assert recorded.keys() == replayed.keys(), where
        for k in recorded:
            if k not in ("e2e_latency",):
                _same_shape(recorded[k], replayed[k], f"{where}.{k}")
    elif isinstance(recorded, list):
        assert isinstance(replayed, list), where
        for a, b in zip(recorded, replayed):
            _same_shape(a, b, where + "[]")
    elif isinstance(recorded, bool):
        assert isinstance(replayed, bool), where
    elif isinstance(recorded, (int, float)):
        assert isinstance(replayed, (int, float)) and not isinstance(replayed, bool), where
    else:
        assert type(replayed) is type(recorded), where


def _select_scores(texts: list[str], choices: list[str], answers: list[dict]) -> list[float]:
    """The frontend's normalized score of each choice (``RuntimeEndpoint.select``): the mean of
    the non-null prompt logprobs, without the first entry's token when the prefix ends with it."""
    prefix = texts[0][: len(texts[0]) - len(choices[0])]
    scores = []
    for a in answers:
        entries = a["meta_info"]["input_token_logprobs"]
        values = [e[0] for e in entries if e[0]]
        score = sum(values) / len(values)
        if prefix.endswith(entries[0][2]):
            score = (score * len(entries) - entries[0][0]) / (len(entries) - 1)
        scores.append(score)
    return scores


CHOICES = ["useful", "vague", "harmful"]  # the program's select (tests/fixtures/sglang_frontend/program.py)


def _replay(http_base: str, traffic: list) -> list:
    """Send every recorded exchange again, each in its own thread, once every exchange that had
    completed before it arrived has completed again: the frontend's own order and concurrency
    (its forks and ``run_batch`` programs run side by side, as they did when recorded)."""
    done = [threading.Event() for _ in traffic]
    results: list = [None] * len(traffic)

    def one(i: int, ex: dict) -> None:
        try:
            for j, other in enumerate(traffic):
                if other["done_s"] <= ex["arrived_s"]:
                    assert done[j].wait(300), f"exchange {j} did not finish"
            with httpx.Client(base_url=http_base, timeout=300) as c:
                results[i] = c.request(ex["method"], ex["path"], json=ex["request"])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            results[i] = exc
        finally:
            done[i].set()

    threads = [threading.Thread(target=one, args=(i, ex)) for i, ex in enumerate(traffic)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def test_replay_of_the_sglang_frontend_traffic(server, llm):
    """SGLang's frontend (tests/fixtures/sglang_frontend/program.py: fork(3), gen with a regex,
    select among 3 choices, run_batch, a streamed run) recorded against radixkv; replayed, every
    answer has the recorded status and shape, greedy texts are the same, regex outputs match, and
    the select requests score the choices as recorded."""
    traffic = json.loads((FIXTURES / "traffic.json").read_text())
    output = json.loads((FIXTURES / "output.json").read_text())
    assert [ex["path"] for ex in traffic[:3]] == ["/get_model_info", "/flush_cache", "/server_info"]
    decisions = []
    for ex, resp in zip(traffic, _replay(server.base_url, traffic)):
        assert not isinstance(resp, BaseException), resp
        req = ex["request"]
        assert resp.status_code == ex["status"], (ex["path"], req, resp.text)
        if ex["content_type"] == "text/event-stream":
            got = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
            got = [g if g == "[DONE]" else json.loads(g) for g in got]
            assert got[-1] == "[DONE]" == ex["response"][-1]
            _same_shape(ex["response"][-2], got[-2])
            assert got[-2]["text"] == ex["response"][-2]["text"]  # greedy
            if req["sampling_params"].get("regex"):
                assert re.fullmatch(req["sampling_params"]["regex"], got[-2]["text"])
            continue
        got = resp.json()
        _same_shape(ex["response"], got, ex["path"])
        if ex["path"] != "/generate":
            continue
        sp = req.get("sampling_params") or {}
        if isinstance(got, dict):
            assert sp.get("temperature") == 0 or sp.get("max_new_tokens") == 0, sp  # the program is greedy
            assert got["text"] == ex["response"]["text"], req["text"][-80:]
            if sp.get("regex"):
                assert re.fullmatch(sp["regex"], got["text"]), got["text"]
        if req.get("return_logprob"):  # select: one answer per choice, scored as the frontend does
            assert [t[-len(c) :] for t, c in zip(req["text"], CHOICES)] == CHOICES
            scores = _select_scores(req["text"], CHOICES, got)
            assert scores == pytest.approx(_select_scores(req["text"], CHOICES, ex["response"]), abs=1e-4)
            decisions.append(max(range(len(scores)), key=lambda i: scores[i]))
    verdicts = [b["verdict"] for b in output["batch"]] + [output["stream"]["verdict"]]
    assert len(decisions) == 4 and sorted(CHOICES[d] for d in decisions) == sorted(verdicts)
    for b in output["batch"] + [output["stream"]]:
        assert re.fullmatch(r"(10|[1-9])", b["score"]) and b["verdict"] in CHOICES and len(b["tips"]) == 3
    assert_pool_whole(llm)


def test_server_info_config_values_are_json_not_python_reprs():
    """``radixkv_config`` holds the resolved config's objects as JSON: the speculative config's
    fields, the tier write policy and tenant quotas as objects (a client reads
    ``radixkv_config["speculative_config"]["method"]``), not ``"SpeculativeConfig(method=...)"``."""
    from types import SimpleNamespace

    from radixkv.config import EngineConfig
    from radixkv.server.backend import model_facts_of
    from radixkv.spec import SpeculativeConfig

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = EngineConfig(device="cpu", speculative_config=spec, tenant_kv_quota_tokens={"alice": 100}).resolve()
    engine = SimpleNamespace(config=cfg, tokenizer=None, vocab_size=49152, max_context_len=2048)
    got = json.loads(json.dumps(model_facts_of(engine).config))
    assert got["speculative_config"] == SpeculativeConfig(**spec).as_dict()
    assert got["speculative_config"]["num_speculative_tokens"] == 3 and got["speculative_config"]["adaptive"] is True
    assert got["tenant_kv_quota_tokens"] == {"alice": 100}
    assert got["kv_tier_write_policy"] == cfg.kv_tier_write_policy and isinstance(got["kv_tier_write_policy"], dict)
    assert got["dtype"] == str(cfg.dtype) and got["page_size"] == 1
    off = model_facts_of(
        SimpleNamespace(config=EngineConfig(device="cpu").resolve(), tokenizer=None, vocab_size=1, max_context_len=2)
    )
    assert off.config["speculative_config"] is None
