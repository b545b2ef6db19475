"""Request fields combined, against the real engine (default model, CPU) with the ``openai``
SDK and plain HTTP: streamed answers joined equal the non-streamed ones field for field (text,
logprobs, tool calls, finish reasons, usage), and a server with speculative decoding
(``--speculative-config``) answers what the plain one answers, greedy and seeded.

Two servers share the session's loaded model: ``server`` (conftest's, over ``llm``) and
``spec_server`` (radix speculation, 5 tokens)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_helpers import Server, assert_pool_whole, new_async_llm  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
SPEC = {"method": "radix", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def llm(default_model):
    a = new_async_llm(default_model, max_total_tokens=4096)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def spec_llm(default_model):
    a = new_async_llm(default_model, max_total_tokens=4096, speculative_config=SPEC)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def spec_server(spec_llm):
    from radixkv.server.app import create_app

    s = Server(create_app(spec_llm, served_model_name=MODEL))
    yield s
    s.stop()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base_url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request (``data: [DONE]`` checked and dropped)."""
    events = []
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    return chunks


# ---------------------------------------------------------------------------------- completions


def joined_completion_choices(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: the joined text, logprobs (each list concatenated) and finish reason."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch["choices"]:
            j = out.setdefault(c["index"], {"text": "", "logprobs": None, "finish_reason": None})
            j["text"] += c["text"]
            if c["logprobs"] is not None:
                lp = j["logprobs"] = j["logprobs"] or {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    lp[k] += v
            j["finish_reason"] = c["finish_reason"] or j["finish_reason"]
    return out


def test_streamed_echo_logprobs_with_n_samples_and_several_prompts_join_to_the_answer(server, llm):
    """``echo`` + ``logprobs`` + ``n = 2`` + two prompts + a stop string, streamed: each choice's
    chunks join to its non-streamed text and logprobs, the prompt's tokens once at the front (a
    sample's first chunk can come before its first token: its prompt logprobs were sent a second
    time with its first token's), and the usage chunk equals the non-streamed usage."""
    body = dict(
        model=MODEL, prompt=["The capital of France is", "Once upon a time"], max_tokens=10, temperature=0.9,
        seed=1, n=2, echo=True, logprobs=2, stop=[","],
    )  # fmt: skip
    whole = post(server, "/v1/completions", body)
    chunks = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # echo + logprobs computes the whole prompt again (cached_tokens 0), so both runs have the same bits
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    joined = joined_completion_choices(chunks[:-1])
    assert sorted(joined) == [0, 1, 2, 3]
    tok = llm.tokenizer
    for c in whole["choices"]:
        j, prompt = joined[c["index"]], body["prompt"][c["index"] // 2]
        assert j["text"] == c["text"] and c["text"].startswith(prompt)
        assert j["finish_reason"] == c["finish_reason"]
        lp = c["logprobs"]
        n_prompt = len(tok.encode(prompt, add_special_tokens=False))
        assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
        assert "".join(lp["tokens"][:n_prompt]) == prompt
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert j["logprobs"] == lp
    assert_pool_whole(llm)
