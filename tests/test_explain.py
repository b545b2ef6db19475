"""``radixkv explain`` on real text: synthetic agent traces (real ShareGPT questions behind a long
system prompt with one volatile span each, and a control trace without), the multi-turn
ShareGPT trace, the reports (terminal, JSON, self-contained HTML) and the trace writers.

For each volatile kind the explainer must find the span, name its place and an example, report
the low hit rate, and predict the hit rate of the fixed trace; the fixed trace is written
independently at the source (radixkv/obs/synthetic.py, ``fixed=True``) and replayed through the
engine, which must give that rate within 1 point.

Which engine: the prompts are given as token ids and each request is sent after the previous one
finished (an agent loop), so what the prefix cache holds depends on the prompts and the lengths
of the outputs only, never on the output tokens (a single-turn prompt never contains an earlier
output). The full traces therefore run through the real Engine (scheduler, KV manager, radix
tree) over a runner without a model (tests/obs_helpers.py), and one test replays the first
requests of a fixed trace through the real default model too and checks that every request gets
exactly the cached tokens it got there.
"""

from __future__ import annotations

import base64
import json
import re

import pytest
from obs_helpers import null_engine

from radixkv.obs.explain import explain_trace
from radixkv.obs.report import explain_html, explain_text_report, to_json
from radixkv.obs.synthetic import FIX_OF, agent_trace, sharegpt_multi_turn_trace
from radixkv.obs.trace import TraceWriter, read_trace, tokenize_trace, write_trace
from radixkv.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)


def test_a_body_asking_for_prompt_logprobs_is_replayed_with_the_engines_match_limit(default_model, tok):
    """A request with prompt logprobs from ``logprob_start_len`` s matches at most ``max(s, 1) - 1``
    tokens (their logits must be computed); a completions ``echo`` with ``logprobs`` asks for
    them (s 0). The replay of the trace ignored it and counted the whole cached prompt: 40 and
    40 where the engine reused 0 and 9."""
    from radixkv.llm import LLM
    from radixkv.sim import simulate

    llm = LLM(loaded_model=default_model, device="cpu", max_total_tokens=4096)
    text = "The quick brown fox jumps over the lazy dog. " * 4
    bodies = [
        {"prompt": text, "max_tokens": 1},
        {"prompt": text, "max_tokens": 1, "echo": True, "logprobs": 0},
        {"prompt": text, "max_tokens": 1, "prompt_logprobs": 1, "logprob_start_len": 10},
        {"prompt": text, "max_tokens": 1, "echo": True},  # no logprobs: nothing to compute
    ]
    params = [{}, {"prompt_logprobs": 0}, {"prompt_logprobs": 1, "logprob_start_len": 10}, {}]
    got = []
    for p in params:
        out = llm.generate([text], SamplingParams(max_tokens=1, temperature=0.0, **p), use_tqdm=False)[0]
        got.append(out.num_cached_tokens)
    reqs = tokenize_trace(bodies, tok)
    assert [r.max_prefix_len for r in reqs] == [None, 0, 9, None]
    sim = simulate([r.sim_request() for r in reqs], "radix", 1, 4096)
    assert [r.num_cached_tokens for r in sim.requests] == got == [0, 0, 9, len(reqs[0].tokens) - 1]
    llm.close()


N = 40
KIND_NAMES = {"timestamp": "timestamp", "uuid": "uuid", "user": "name", "tools": "reordered list"}
LINES = {"timestamp": 1, "uuid": 3, "user": 3}  # line of the system message the value is on


@pytest.fixture(scope="module")
def tok(default_model):
    return default_model.tokenizer


@pytest.fixture(scope="module")
def questions():
    from radixkv.datasets import load_conversations

    return [c[0] for c in load_conversations(N, 1, 800)]


def engine_hit_rate(tokenizer, reqs, capacity=32768):
    """Replay requests one after the other through the engine (null runner); returns the hit
    rate and the cached tokens of each."""
    eng = null_engine(tokenizer, capacity=capacity)
    params = SamplingParams(max_tokens=1, temperature=0)
    cached = []
    for r in reqs:
        rid = eng.add_request(r.tokens, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished and out.request_id == rid:
                    cached.append(out.num_cached_tokens)
    eng.check_integrity()
    return sum(cached) / sum(len(r.tokens) for r in reqs), cached


@pytest.mark.parametrize("kind", ["timestamp", "uuid", "user", "tools"])
def test_explain_finds_the_volatile_span_and_predicts_the_fix(kind, tok, questions):
    bodies = agent_trace(kind, N, questions=questions)
    reqs = tokenize_trace(bodies, tok)
    rep = explain_trace(reqs, tok, sweep=())
    control = explain_trace(tokenize_trace(agent_trace("control", N, questions=questions), tok), tok, sweep=())
    assert rep["hit_rate"] < control["hit_rate"] - 0.25  # the span costs a lot
    assert rep["causes_sum_to_missed"] and sum(rep["missed_by_cause"].values()) == rep["missed_tokens"]
    assert len(rep["spans"]) == 1, [(s["kind"], s["position"]) for s in rep["spans"]]
    span = rep["spans"][0]
    assert span["kind"] == KIND_NAMES[kind]
    pos = span["position"]
    assert (pos["message"], pos["role"]) == (0, "system")
    if kind in LINES:
        assert pos["line"] == LINES[kind]
    else:
        assert pos["line"] >= 4  # inside the tool list (header on line 3)
    systems = [b["messages"][0]["content"] for b in bodies]
    assert sum(span["examples"][0].strip() in s for s in systems) >= 1  # a real value of the span
    assert span["requests"] >= N // 3 and span["located_in"] >= N - 1
    predicted = span["what_if"][FIX_OF[kind]]["hit_rate"]
    fixed = tokenize_trace(agent_trace(kind, N, fixed=True, questions=questions), tok)
    actual, _ = engine_hit_rate(tok, fixed)
    assert abs(predicted - actual) <= 0.01, (kind, predicted, actual)
    assert actual > rep["hit_rate"] + 0.25
    text = explain_text_report(rep)
    assert span["kind"] in text and "what if" in text


def test_control_trace_has_no_volatile_span_and_the_engine_agrees(tok, questions):
    reqs = tokenize_trace(agent_trace("control", N, questions=questions), tok)
    rep = explain_trace(reqs, tok, sweep=())
    assert rep["spans"] == [] and rep["hit_rate"] > 0.9
    actual, _ = engine_hit_rate(tok, reqs)
    assert actual == pytest.approx(rep["hit_rate"], abs=1e-12)  # the replay is the engine's


def test_the_real_model_caches_what_the_null_runner_engine_caches(default_model, tok, questions):
    from radixkv.llm import LLM

    reqs = tokenize_trace(agent_trace("timestamp", 4, fixed=True, questions=questions), tok)
    _, expected = engine_hit_rate(tok, reqs, capacity=4096)
    llm = LLM(loaded_model=default_model, device="cpu", max_total_tokens=4096)
    got = [
        llm.generate(prompt_token_ids=[r.tokens], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)[0]
        for r in reqs
    ]
    assert [o.num_cached_tokens for o in got] == expected
    assert expected[0] == 0 and min(expected[1:]) > 1000  # the long system prompt is shared


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_reply_cut_off_at_max_tokens_is_replayed_as_the_engine_cached_it(default_model, tok, page_size):
    """Multi-turn chats whose replies stop at ``max_tokens`` (as ``radixkv replay --log-requests``
    logs them): the replay of the trace gives each request exactly the engine's cached tokens. The
    end-of-turn token the template puts after a cut-off reply was taken as generated, so every
    later turn was predicted one token more than the engine caches (a whole page more at page 16
    where the reply ends on a page boundary)."""
    from radixkv.llm import LLM
    from radixkv.sim import simulate

    llm = LLM(loaded_model=default_model, device="cpu", max_total_tokens=4096, page_size=page_size)
    questions = ["Name three rivers of Europe.", "What is a prime number?", "Why is the sky blue?"]
    follow = ["And in Asia?", "Give an example.", "Say it shorter."]
    bodies, got = [], []
    hist = [[{"role": "user", "content": q}] for q in questions]
    for turn in range(3):
        for i, h in enumerate(hist):
            if turn:
                h.append({"role": "user", "content": f"{follow[i]} (turn {turn})"})
            bodies.append({"model": "m", "messages": [dict(m) for m in h], "max_tokens": 7 + i})
            out = llm.chat(h, SamplingParams(max_tokens=7 + i, temperature=0.0), use_tqdm=False)[0]
            assert out.outputs[0].finish_reason == "length"
            got.append(out.num_cached_tokens)
            h.append({"role": "assistant", "content": out.outputs[0].text})
    reqs = tokenize_trace(bodies, tok)
    assert [len(r.reply) for r in reqs[:6]] == [7, 8, 9, 7, 8, 9]
    sim = simulate([r.sim_request() for r in reqs], "radix", page_size, 4096)
    assert [r.num_cached_tokens for r in sim.requests] == got
    assert min(got[3:]) > 20
    llm.close()


def test_sharegpt_multi_turn_report_causes_sum_exactly(tok):
    bodies = sharegpt_multi_turn_trace(24, 4)
    reqs = tokenize_trace(bodies, tok)
    assert len(reqs) == 96 and sum(1 for r in reqs if r.reply) == 72  # every turn but the last has one
    for capacity in (None, 8192):
        rep = explain_trace(reqs, tok, capacity=capacity, sweep=(0.1, 1.0))
        assert rep["causes_sum_to_missed"]
        assert sum(rep["missed_by_cause"].values()) == rep["prompt_tokens"] - rep["cached_tokens"]
        if capacity is None:
            assert rep["hit_rate"] > 0.5 and "evicted" not in rep["missed_by_cause"]
            unlimited = rep
        else:
            assert rep["missed_by_cause"].get("evicted", 0) > 0 and rep["hit_rate"] < unlimited["hit_rate"]
    no_replies = explain_trace(tokenize_trace(bodies, tok, infer_replies=False), tok, capacity=None, spans=False)
    assert no_replies["hit_rate"] < unlimited["hit_rate"]  # the replies are part of the next prompts


def test_html_report_is_complete_and_self_contained(tok, questions, tmp_path):
    reqs = tokenize_trace(agent_trace("timestamp", 16, questions=questions), tok)
    rep = explain_trace(reqs, tok, sweep=(0.1, 0.5, 1.0))
    page = explain_html(rep)
    imgs = re.findall(r'<img[^>]*src="([^"]+)"', page)
    assert len(imgs) == 3 and all(u.startswith("data:image/png;base64,") for u in imgs)
    for u in imgs:
        assert base64.b64decode(u.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"<(script|link|iframe|object)\b", page, re.I)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page, re.I) and "url(" not in page
    assert "timestamp" in page and page.rstrip().endswith("</html>")
    json.loads(to_json(rep))


def test_cli_explain_json_and_html(tok, questions, tmp_path, capsys):
    from radixkv.cli import main

    trace = write_trace(tmp_path / "t.jsonl", agent_trace("uuid", 12, questions=questions))
    html_path = tmp_path / "r.html"
    assert main(["explain", str(trace), "--json", "--html", str(html_path), "--capacity", "inf"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["requests"] == 12 and rep["spans"][0]["kind"] == "uuid" and html_path.read_text().startswith("<!DOCTYPE")
    assert main(["explain", str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    assert main(["explain", str(bad)]) == 2 and "bad.jsonl:2" in capsys.readouterr().err
    # a line that is not UTF-8: named (it said only "'utf-8' codec can't decode byte 0xff in position 0")
    bad.write_bytes(b'{"prompt": "hi"}\n\xff\xfe{"prompt": "x"}\n')
    assert main(["explain", str(bad)]) == 2 and "bad.jsonl:2: not UTF-8 text" in capsys.readouterr().err
    # a server's --log-requests trace also holds the bodies it answered with a 400: skipped, said
    served = [{"messages": [{"role": "user", "content": q}]} for q in questions[:3]]
    logged = write_trace(tmp_path / "log.jsonl", served[:2] + [{"prompt": [], "max_tokens": 2}] + served[2:])
    assert main(["explain", str(logged), "--json", "--no-what-if"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["requests"] == 3 and "skipped 1 invalid request bodies (first: request 3" in cap.err
    assert main(["explain", str(write_trace(tmp_path / "none.jsonl", [{"prompt": []}]))]) == 2


@pytest.mark.parametrize(
    "argv, why",
    [
        (["explain", "synthetic:uuid", "--html", "{missing}/r.html"], "cannot write '{missing}/r.html'"),
        (["explain", "synthetic:uuid", "--output", "{tmp}"], "cannot write '{tmp}'"),
        (["plan", "--model", "llama-3-8b", "--trace", "synthetic:uuid", "--html", "{missing}/r.html"], "cannot write"),
        (["explain", "sharegpt:multi_turn:x"], "CONVERSATIONS must be an integer >= 1, got 'x'"),
        (["explain", "synthetic:uuid:0"], "N must be an integer >= 1, got '0'"),
        (["explain", "synthetic:uuid", "--top", "-1"], "--top must be >= 0, got -1"),
        # a spec's extra or misspelt parts were ignored (synthetic:uuid:5:fixd replayed the unfixed trace)
        (["explain", "synthetic:uuid:5:fixd"], "synthetic:KIND[:N[:fixed]], got 'synthetic:uuid:5:fixd'"),
        (["explain", "sharegpt:multi_turn:2:3:4"], "sharegpt:multi_turn[:CONVERSATIONS[:TURNS]], got"),
        # more than ShareGPT has: a RuntimeError traceback, or (multi_turn) silently fewer conversations
        (["explain", "synthetic:uuid:100000"], "only 14527 ShareGPT conversations"),
        (["explain", "sharegpt:multi_turn:99999"], "only 3646 ShareGPT conversations have 4 human/gpt pairs"),
        # a byte size where tokens are asked for: argparse said "invalid _capacity value: '1.5GiB'"
        (["explain", "synthetic:uuid", "--capacity", "1.5GiB"], "capacity must be an integer >= 1 (tokens) or 'inf'"),
        (
            ["explain", "synthetic:uuid", "--capacity", "0"],
            "capacity must be an integer >= 1 (tokens) or 'inf', got '0'",
        ),
        # a pool below one page (the engine refuses it): it was replayed at one page of 5,000
        # tokens, every prompt fitting, under a header that said capacity 100
        (
            ["explain", "synthetic:uuid:3", "--capacity", "100", "--page-size", "5000"],
            "radixkv explain: --capacity 100 holds no page of --page-size 5000 tokens",
        ),
    ],
)
def test_cli_bad_input_is_refused_before_the_work(argv, why, tmp_path, capsys):
    """An output path that cannot be written or a malformed trace spec: exit 2 with a message
    naming it, before the trace is replayed (nothing is written)."""
    from radixkv.cli import main

    fill = dict(missing=str(tmp_path / "no" / "such"), tmp=str(tmp_path))
    try:
        code = main([a.format(**fill) for a in argv])
    except SystemExit as exc:  # argparse's own refusal (a bad option value)
        code = exc.code
    assert code == 2
    assert why.format(**fill) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_replay_writes_the_trace_format(tok, tmp_path):
    from obs_helpers import NullRunner

    from radixkv.datasets import load_conversations
    from radixkv.llm import LLM
    from radixkv.replay import replay_mode

    # the replies' contents do not matter here: the runner without a model answers token 0
    llm = LLM(model_runner=NullRunner(len(tok)), tokenizer=tok, eos_token_ids=[], device="cpu", max_total_tokens=8192)
    path = tmp_path / "replay.jsonl"
    convs = load_conversations(2, 2, 300)
    with TraceWriter(path) as log:
        row = replay_mode(llm, convs, 4, progress=False, log=log)
    bodies = read_trace(path)
    assert len(bodies) == row["requests"] == 4
    assert [b["messages"][-1]["content"] for b in bodies] == [convs[0][0], convs[1][0], convs[0][1], convs[1][1]]
    assert bodies[2]["messages"][1]["role"] == "assistant"  # the model's own earlier reply
    reqs = tokenize_trace(bodies, llm.tokenizer)
    assert sum(len(r.tokens) for r in reqs) == row["prompt_tokens"]  # the same prompts the engine saw
    assert reqs[0].reply and reqs[1].reply and not reqs[2].reply


def test_cause_table_says_what_full_is_and_a_flat_trace_plot_is_left_out():
    """The cause table names each cause's tokens (``full``: each prompt's last token) beside the
    requests it is the main cause of; a trace whose hit rate never moves and has no fix gets no
    hit-rate-over-the-trace plot (it would be two flat lines), the other plots stay."""
    from radixkv.sim import SimRequest

    same = list(range(10, 30))
    reqs = [SimRequest(same)] * 3 + [SimRequest([1000 + 50 * i + j for j in range(20)]) for i in range(30)]
    rep = explain_trace(reqs, spans=False, sweep=(0.5, 1.0))
    assert rep["missed_by_cause"] == {"full": 33, "cold": 19 * 31}
    assert rep["requests_by_cause"] == {"full": 2, "cold": 31}
    text = explain_text_report(rep)
    assert "by cause (sums exactly; requests: how many it is the main cause of):" in text
    assert (
        "  full                 33    5.3%         2  each prompt's last token, always computed (its requests: all else cached)"
        in text
    )
    assert (
        "  cold                589   94.7%        31  never seen (or evicted longer ago than the record reaches)"
        in text
    )
    flat = explain_trace(
        [SimRequest([1000 + 50 * i + j for j in range(20)]) for i in range(30)], spans=False, sweep=(1.0,)
    )
    assert rep["series"]["fix"] is None and flat["series"]["fix"] is None
    assert max(flat["series"]["rolling"]) == 0.0
    titles = re.findall(r"<h2>([^<]*)</h2><img", explain_html(flat))
    assert titles == ["Missed tokens by cause", "Hit rate vs capacity"]
    assert re.findall(r"<h2>([^<]*)</h2><img", explain_html(rep))[0] == "Hit rate over the trace"


def test_the_fix_predicted_line_over_the_trace(tok, questions):
    """With a volatile span, the hit-rate-over-the-trace plot carries the best what-if's replay
    request by request: its cumulative line ends at that what-if's hit rate."""
    reqs = tokenize_trace(agent_trace("timestamp", 16, questions=questions), tok)
    rep = explain_trace(reqs, tok, sweep=())
    fix = rep["series"]["fix"]
    what_if = rep["spans"][0]["what_if"]
    best = max(v["hit_rate"] for v in what_if.values())
    assert fix["hit_rate"] == best == what_if[fix["how"]]["hit_rate"] and fix["span"] == 0
    assert fix["how"] == next(h for h in ("static", "moved", "removed") if what_if[h]["hit_rate"] == best)
    words = {"static": "made static", "moved": "moved after the shared part", "removed": "removed"}
    assert fix["label"] == f"the timestamp span (#0) {words[fix['how']]}"
    assert fix["cumulative"][-1] == best and fix["index"] == rep["series"]["index"]
    assert fix["cumulative"][-1] > rep["series"]["cumulative"][-1] + 0.5
    assert all("series" not in v for v in what_if.values())  # taken out into series.fix


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def server_prompt_ids(tok, body):
    """The prompt token ids ``/v1/chat/completions`` computes for ``body`` (its own code path)."""
    from radixkv.chat_template import encode_chat, request_template_options
    from radixkv.server.openai.params import tool_plan
    from radixkv.server.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(model="smollm2-135m", **body)
    opts = request_template_options(req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    return encode_chat(tok, [m.to_template() for m in req.messages], tools=tool_plan(req).tools or None, **opts)


def test_a_tool_agent_trace_is_tokenized_as_the_server_renders_it(tok):
    """A logged agent loop with ``tools``, an assistant ``tool_calls`` turn, a ``tool`` result and
    a refusal part: every request's prompt is the server's, token for token (the tools were
    dropped: 31 tokens instead of the server's 160-odd, and a refusal part skipped the body), and
    the tool-call turn is inferred as the first request's reply, so the second request is cached
    through it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    first = [{"role": "system", "content": "You are a weather bot."}, {"role": "user", "content": "Paris?"}]
    second = first + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    bodies = [
        {"messages": first, "tools": [WEATHER], "max_tokens": 32},
        {"messages": second, "tools": [WEATHER], "tool_choice": "none", "n": 2},
        {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, first[1]]},
        # a refusal beside empty content is the message (the server's); the trace rendered an empty turn
        {"messages": [first[1], {"role": "assistant", "content": "", "refusal": "I cannot."}, first[1]]},
        {
            "messages": [{"role": "user", "content": "Wetter in Köln? 天気 🌦"}],
            "response_format": {"type": "json_object"},
        },
        # vLLM's template fields: a prefilled assistant message continued, no new turn (the trace ignored them)
        {"messages": [first[1], {"role": "assistant", "content": "It is"}], "continue_final_message": True,
         "add_generation_prompt": False},
        {"messages": first, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}},
    ]  # fmt: skip
    reqs = tokenize_trace(bodies, tok)
    assert tok.decode(reqs[5].tokens).endswith("assistant\nIt is")
    assert [r.tokens for r in reqs] == [server_prompt_ids(tok, b) for b in bodies]
    assert "get_weather" in reqs[0].text and "<tool_call>" in reqs[1].text and "No." in reqs[2].text
    n0 = len(reqs[0].tokens)
    assert reqs[0].reply == reqs[1].tokens[n0 : reqs[1].tokens.index(tok.eos_token_id, n0) + 1]
    rep = explain_trace(reqs[:2], tok, spans=False, sweep=())
    cached = {m["index"]: m["cached_tokens"] for m in rep["top_misses"]}
    assert cached == {0: 0, 1: n0 + len(reqs[0].reply) - 1}


@pytest.mark.parametrize(
    "prompt, why",
    [
        ([-5, 3], "prompt token 0 must be an integer token id in [0, 49152), got -5"),
        ([7, True], "prompt token 1 must be an integer token id in [0, 49152), got True"),
        ([49152], "prompt token 0 must be an integer token id in [0, 49152), got 49152"),
        ([[1, 2], [3, 2**40]], "prompt token 1 must be an integer token id in [0, 49152), got 1099511627776"),
        ([1.5, 2], "prompt must be a string, a token list, or a list of those, got 1.5"),
        ("", "the prompt has no tokens"),
    ],
)
def test_token_id_prompts_out_of_the_vocabulary_are_invalid_bodies(prompt, why, tok, tmp_path, capsys):
    """A completions body whose token ids the server would refuse (negative, a bool, past the
    vocabulary, not an int) is an invalid body, skipped with its reason; a negative id crashed
    ``radixkv explain`` with an OverflowError traceback from the tokenizer's decode, a bool was
    taken as token 1."""
    from radixkv.cli import main

    good = {"prompt": [5, 6, 7, 8]}
    trace = write_trace(tmp_path / "t.jsonl", [good, {"prompt": prompt}, good])
    assert main(["explain", str(trace), "--json", "--no-what-if"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["requests"] == 2
    assert f"skipped 1 invalid request bodies (first: request 2: {why})" in cap.err


def test_a_top_miss_names_the_line_of_the_file_its_body_is_on(tok, tmp_path, capsys):
    """Blank lines are skipped in a trace (a hand-edited one, or two logs joined): each top miss
    names the file line its body is on (it named the body's position: 'line 1' and 'line 2' for
    bodies on lines 3 and 5); ``radixkv plan`` names why it skipped a body, as explain does."""
    from radixkv.cli import main

    path = tmp_path / "t.jsonl"
    body = '{"prompt": [5, 6, 7, 8, 9]}'
    path.write_text("\n\n" + body + "\n\n" + body.replace("9", "10") + "\n" + '{"model": "m"}' + "\n")
    assert main(["explain", str(path), "--json", "--no-what-if"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert sorted((m["index"], m["line"]) for m in rep["top_misses"]) == [(0, 3), (1, 5)]
    assert main(["plan", "--trace", str(path), "--policies", "radix-p1"]) == 0
    why = "a body needs 'messages' (chat) or 'prompt' (completions)"
    assert f"skipped 1 invalid request bodies of the trace (first: request 3: {why})" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"cache_salt": ""}, "cache_salt must be a non-empty string of at most 128 characters, got 0 characters"),
        (
            {"cache_salt": "s" * 129},
            "cache_salt must be a non-empty string of at most 128 characters, got 129 characters",
        ),
        ({"cache_salt": 7}, "cache_salt must be a string, got int"),
        ({"tenant": ["a"]}, "tenant must be a non-empty string, got list"),
    ],
)
def test_a_malformed_cache_salt_or_tenant_is_an_invalid_body(extra, why, tok, tmp_path, capsys):
    """A body whose ``cache_salt`` the server refuses (empty, over 128 characters, not a string)
    is an invalid body, skipped with its reason; it was replayed without a salt, in the shared
    namespace, so its prompt hit the cache the server would never let it see."""
    from radixkv.cli import main

    good = {"prompt": [5, 6, 7, 8, 9]}
    trace = write_trace(tmp_path / "t.jsonl", [good, dict(good, **extra), good])
    assert main(["explain", str(trace), "--json", "--no-what-if"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    assert (rep["requests"], rep["cached_tokens"]) == (2, 4)
    assert f"skipped 1 invalid request bodies (first: request 2: {why})" in cap.err


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--output", "{missing}/rows.json"], "cannot write '{missing}/rows.json'"),
        (["--log-requests", "{missing}/trace.jsonl"], "cannot write '{missing}/trace.jsonl'"),
        (["--skip", "-5"], "--skip must be >= 0"),
        (["--conversations", "100000"], "only "),
    ],
)
def test_cli_replay_bad_input_is_refused_before_the_work(argv, why, tmp_path, capsys):
    """``radixkv replay`` with an output or trace file in a folder that does not exist ran the whole
    replay and then died with a FileNotFoundError traceback (the trace's: after loading the model);
    a negative ``--skip`` or more conversations than ShareGPT has raised a RuntimeError traceback
    ("only 0 ShareGPT conversations have ..."). Each is exit 2 and one line naming it, before the
    model loads."""
    from radixkv.cli import main

    fill = dict(missing=str(tmp_path / "no" / "such"))
    small = ["replay", "--conversations", "1", "--turns", "1", "--max-tokens", "1", "--modes", "off", "--no-progress"]
    assert main(small + [a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert why.format(**fill) in err and "loaded" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_llm_explain_takes_the_tools_a_chat_was_sent_with(tok):
    """``LLM.explain`` of a conversation that was chatted with ``tools`` renders them as ``chat``
    does: the whole prompt but its last token is cached (cause ``full``). It had no ``tools``, so
    the dry run explained a different prompt (the conversation without its tool block, which
    diverged from the cached one after the system message's first tokens)."""
    from obs_helpers import NullRunner

    from radixkv.errors import RequestError
    from radixkv.llm import LLM

    llm = LLM(model_runner=NullRunner(len(tok)), tokenizer=tok, eos_token_ids=[], device="cpu", max_total_tokens=4096)
    chat = [{"role": "system", "content": "You are a weather bot."}, {"role": "user", "content": "Paris?"}]
    out = llm.chat(chat, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False, tools=[WEATHER])[0]
    n = len(out.prompt_token_ids)
    ex = llm.explain(chat, tools=[WEATHER])
    assert (ex.outcome.cause, ex.outcome.num_prompt_tokens, ex.outcome.num_cached_tokens) == ("full", n, n - 1)
    plain = llm.explain(chat)
    assert plain.outcome.cause == "diverged" and plain.outcome.num_prompt_tokens < n
    with pytest.raises(RequestError, match="apply to a conversation only"):
        llm.explain("Paris?", tools=[WEATHER])
    llm.close()


def test_cli_explain_replays_the_servers_radix_eviction_policy(tmp_path, capsys):
    """A server run with ``--radix-eviction-policy lfu`` keeps the prompt used three times and
    evicts (the tail of) the one used once; ``radixkv explain`` had no such flag and replayed LRU,
    which evicts the frequent prompt's tail: its last repeat got 20 cached tokens in the report
    and 39 on the server. The replay
    under each policy equals the engine's (tests/test_sim_eviction.py, test_sim.py)."""
    from radixkv.cli import main
    from radixkv.sim import SimRequest, simulate

    a, b, c = ([base + i for i in range(40)] for base in (100, 200, 300))
    trace = write_trace(tmp_path / "t.jsonl", [{"prompt": p} for p in (a, a, a, b, c, a)])
    common = ["explain", str(trace), "--capacity", "100", "--json", "--no-what-if"]
    reqs = [SimRequest(p) for p in (a, a, a, b, c, a)]
    for evict, policy, last in (("lru", "radix", 20), ("lfu", "radix-lfu", 39)):
        assert main(common + ["--radix-eviction-policy", evict]) == 0
        rep = json.loads(capsys.readouterr().out)
        sim = simulate(reqs, policy, 1, 100)
        assert rep["config"]["policy"] == policy and rep["cached_tokens"] == sim.cached_tokens == 2 * 39 + last
        assert sim.requests[-1].num_cached_tokens == last
    assert main(["explain", str(trace), "--policy", "hash", "--radix-eviction-policy", "lfu"]) == 2
    assert "--radix-eviction-policy needs --policy radix" in capsys.readouterr().err


def test_a_capacity_past_the_trace_replays_as_infinite_without_allocating_it():
    """``--capacity 100000000000``: the replay allocated a slot array of that size (numpy's
    MemoryError traceback: 373 GiB); a capacity at least the trace's bound never runs short, so
    it replays as infinite, and the report keeps the capacity asked for."""
    from radixkv.sim import SimRequest, capacity_bound

    reqs = [SimRequest([1000 + j for j in range(30)])] * 2 + [SimRequest([9, 8, 7, 6, 5])]
    huge = explain_trace(reqs, spans=False, capacity=10**11, sweep=())
    exact = explain_trace(reqs, spans=False, capacity=capacity_bound(reqs), sweep=())
    assert huge["config"]["capacity"] == 10**11 and huge["cached_tokens"] == exact["cached_tokens"] == 29
    assert huge["missed_by_cause"] == exact["missed_by_cause"] == {"full": 3, "cold": 29 + 4}


def test_llm_explain_takes_the_cache_salt_a_request_was_sent_with(tok):
    """A chat sent with ``SamplingParams(cache_salt=...)`` is cached in that salt's namespace:
    ``LLM.explain(..., cache_salt=...)`` (or a dict prompt's ``"cache_salt"``) explains it there.
    The dict's salt was dropped without a word and there was no ``cache_salt`` argument, so the
    dry run said ``namespace`` (0 cached) for a prompt the engine would serve from the cache."""
    from obs_helpers import NullRunner

    from radixkv.errors import RequestError
    from radixkv.llm import LLM

    llm = LLM(model_runner=NullRunner(len(tok)), tokenizer=tok, eos_token_ids=[], device="cpu", max_total_tokens=4096)
    text = "Bikes are the best way to get around a city of hills and rivers."
    out = llm.generate(text, SamplingParams(max_tokens=1, cache_salt="s1"), use_tqdm=False)[0]
    n = len(out.prompt_token_ids)
    assert llm.explain(text).outcome.cause == "namespace"
    for ex in (llm.explain(text, cache_salt="s1"), llm.explain({"prompt": text, "cache_salt": "s1"})):
        assert (ex.outcome.cause, ex.outcome.num_cached_tokens) == ("full", n - 1)
    with pytest.raises(RequestError, match="cache_salt differs"):
        llm.explain({"prompt": text, "cache_salt": "s1"}, cache_salt="s2")
    llm.close()


def test_llm_explain_refuses_a_prompt_the_engine_would_refuse(tok):
    """A prompt past the context: ``LLM.explain`` raises the RequestError that ``generate`` raises
    (naming ``prompt`` and ``max_context_len``); it explained it as ``cold``, 0 of 5,000 tokens
    cached, for a request that can never be admitted."""
    from obs_helpers import NullRunner

    from radixkv.errors import RequestError
    from radixkv.llm import LLM

    llm = LLM(model_runner=NullRunner(len(tok)), tokenizer=tok, eos_token_ids=[], device="cpu", max_total_tokens=2048)
    assert llm.engine.max_context_len == 8192  # the runner's: the pool is the bound here
    with pytest.raises(
        RequestError, match=r"prompt \(2048 tokens\) \+ 1 generated token needs 2049 KV slots, more"
    ) as e:
        llm.explain({"prompt_token_ids": [5] * 2048})
    assert e.value.param == "prompt"
    with pytest.raises(RequestError, match="needs 2049 KV slots, more than the KV pool's 2048 slots"):
        llm.generate({"prompt_token_ids": [5] * 2048}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RequestError, match=r"prompt has 8192 tokens; max_context_len is 8192 \(the prompt plus"):
        llm.explain(prompt_token_ids=[5] * 8192)
    assert llm.explain(prompt_token_ids=[5] * 2047).outcome.num_missed_tokens == 2047
    llm.close()


def test_no_capacity_curve_without_a_prefix_cache():
    """``--policy none`` keeps nothing (working set 0): its hit-rate-vs-capacity line said every
    request was too large for a pool of 100% of the working set; there is no curve to draw."""
    from radixkv.sim import SimRequest

    reqs = [SimRequest([1000 + j for j in range(30)])] * 3
    rep = explain_trace(reqs, policy="none", spans=False, sweep=(0.5, 1.0))
    assert rep["missed_by_cause"] == {"full": 3, "disabled": 87} and rep["capacity_curve"] == []
    assert "hit rate vs capacity" not in explain_text_report(rep) and "too large" not in explain_text_report(rep)
    radix = explain_trace(reqs, spans=False, sweep=(1.0,))["capacity_curve"]
    assert [(p["capacity"], p["skipped"], p["hit_rate"]) for p in radix] == [(30, 0, 58 / 90)]


def test_a_trace_of_another_model_is_named_in_a_warning(tmp_path, capsys):
    """explain (and plan --trace) tokenize a trace with --model (--tokenizer): a trace logged from
    a server of another model was replayed in SmolLM2's tokens without a word. It is a warning, not
    an error (a server's --served-model-name may be any alias of the same model); the replay runs."""
    from radixkv.cli import main

    path = tmp_path / "t.jsonl"
    bodies = [{"model": "llama-3-8b", "prompt": [5, 6, 7, 8]}, {"model": "llama-3-8b", "prompt": [5, 6, 7, 9]}]
    bodies.append({"model": "smollm2-135m", "prompt": [5, 6, 1]})
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    assert main(["explain", str(path), "--json", "--no-what-if"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["requests"] == 3
    assert cap.err.startswith(
        "radixkv explain: warning: the trace names model 'llama-3-8b' (2 requests), not 'smollm2-135m', whose "
        "tokenizer and chat template the replay uses: give --model"
    )
    assert main(["plan", "--trace", str(path), "--policies", "radix-p1"]) == 0
    assert "radixkv plan: warning: the trace names model 'llama-3-8b' (2 requests)" in capsys.readouterr().err
    path.write_text(json.dumps(bodies[2]) + "\n")
    assert main(["explain", str(path), "--no-what-if"]) == 0 and capsys.readouterr().err == ""
