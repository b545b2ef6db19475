"""The sampling pipeline without a model: each logits processor on hand-computed logits, logprobs
and ranks, the grammar bitmask kernel against xgrammar's, and the new SamplingParams fields'
validation (CPU, no weights)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from radixkv.errors import RequestError
from radixkv.kernels import cpu as cpu_kernels
from radixkv.sampling import processors
from radixkv.sampling.logprobs import TokenDecoder, to_position_logprobs, token_logprobs
from radixkv.sampling.pipeline import PromptSegment, SamplingPipeline
from radixkv.sampling_params import SamplingParams


def row(params, prompt=(1,), output=(), pipeline=None):
    r = SimpleNamespace(
        params=params, generator=None, prompt_token_ids=list(prompt), output_token_ids=list(output), sampling_state=None
    )
    if pipeline is not None:
        r.sampling_state = pipeline.new_state(params)
    return r


# ---------------------------------------------------------------------- processors
def test_logit_bias_adds_to_the_given_tokens_only():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    processors.apply_logit_bias(x, [1], [torch.tensor([0, 3])], [torch.tensor([100.0, -2.5])])  # row 0 untouched
    assert x.tolist() == [[0.0, 1.0, 2.0, 3.0], [105.0, 5.0, 5.0, 2.5]]


def test_penalties_follow_hf_and_openai_by_hand():
    # prompt {1}, output [0, 0, 2]; logits of 5 tokens
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    processors.apply_penalties(
        x,
        [0],
        [[0, 0, 2]],
        [processors.token_mask([1], 5)],
        repetition=[2.0],
        frequency=[0.5],
        presence=[0.25],
    )
    # repetition (prompt + output: tokens 0, 1, 2): 2 / 2, -1 * 2, 0.5 / 2; token 3, 4 untouched
    # frequency (output counts 0: 2, 2: 1): -0.5 * count; presence: -0.25 once per seen token
    expected = [2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0, -0.5]
    assert x[0].tolist() == pytest.approx(expected, abs=1e-7)


def test_negative_penalties_and_rows_without_output():
    x = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    processors.apply_penalties(x, [0, 1], [[2, 2], []], [None, None], [1.0, 1.0], [-1.0, 2.0], [-2.0, 2.0])
    assert x.tolist() == [[1.0, 1.0, 1.0 + 2 + 2], [1.0, 1.0, 1.0]]


def test_min_tokens_masks_stop_and_eos_until_reached():
    pipe = SamplingPipeline(6, eos_token_ids=[5])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], max_tokens=8)
    logits = lambda: torch.tensor([[0.0, 0.0, 0.0, 1.0, 9.0, 10.0]])  # noqa: E731
    r = row(p, output=[3], pipeline=pipe)
    assert pipe.step(logits(), [r]).tokens == [3]  # 1 token so far: EOS (5) and stop id 4 masked
    r.output_token_ids.append(3)
    assert pipe.step(logits(), [r]).tokens == [5]  # min_tokens reached
    q = row(p.clone(ignore_eos=True), output=[3], pipeline=pipe)
    assert pipe.step(logits(), [q]).tokens == [5]  # ignore_eos: EOS does not stop, so it is not masked


def test_pipeline_order_bias_then_penalties_then_temperature_greedy():
    pipe = SamplingPipeline(4, eos_token_ids=[])
    # greedy sees bias and penalties: token 3 (3.0) loses to token 1 (1.0 + 2.5)
    p = SamplingParams(temperature=0, logit_bias={1: 2.5}, frequency_penalty=1.0, max_tokens=4)
    r = row(p, output=[3, 3], pipeline=pipe)
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    out = pipe.step(x, [r])
    assert out.tokens == [1]
    assert x.tolist() == [[0.0, 1.0, 2.0, 3.0]]  # a copy is processed: a failed batch is redone from these


def test_unconstrained_rows_take_the_plain_path_untouched():
    pipe = SamplingPipeline(4, eos_token_ids=[0])
    a = row(SamplingParams(temperature=0, presence_penalty=2.0), output=[3], pipeline=pipe)
    b = row(SamplingParams(temperature=0))
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    assert pipe.step(x, [a, b]).tokens == [2, 3]
    assert x[1].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert b.sampling_state is None and SamplingPipeline(4, []).new_state(b.params) is None


# ---------------------------------------------------------------------- logprobs
def test_token_logprobs_ranks_and_topk_by_hand():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    lse = math.log(sum(math.exp(v) for v in (1.0, 3.0, 2.0, 0.0)))
    (e,) = token_logprobs(x, [2], [2])
    assert e.token_id == 2 and e.rank == 2
    assert e.logprob == pytest.approx(2.0 - lse, abs=1e-6)
    assert e.top_ids == [1, 2] and e.top_logprobs == pytest.approx([3.0 - lse, 2.0 - lse], abs=1e-6)
    d = to_position_logprobs(e, TokenDecoder(None))
    assert list(d) == [2, 1] and d[2].rank == 2 and d[1].rank == 1 and d[1].decoded_token is None
    (z,) = token_logprobs(x, [3], [0])  # k = 0: only the token itself
    assert (z.rank, z.top_ids) == (4, []) and len(to_position_logprobs(z, TokenDecoder(None))) == 1


def test_sampled_logprobs_are_of_the_raw_distribution():
    pipe = SamplingPipeline(4, eos_token_ids=[])
    p = SamplingParams(temperature=0, logprobs=1, logit_bias={0: 100.0})
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(x.clone(), -1)
    out = pipe.step(x, [row(p, pipeline=pipe)])
    assert out.tokens == [0]  # the bias decided
    e = out.logprobs[0]
    assert e.logprob == pytest.approx(raw[0, 0].item(), abs=1e-6) and e.rank == 3 and e.top_ids == [1]


def test_prompt_segments_score_the_next_prompt_token():
    pipe = SamplingPipeline(3, eos_token_ids=[])
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0], [5.0, 5.0, 5.0]])
    seg = PromptSegment(row=0, n=2, first=3, targets=[1, 0], k=1)
    res = pipe.step(logits, [row(SamplingParams(temperature=0))], sample_index=[2], prompt_segments=[seg])
    (a, b) = res.prompt_logprobs[0]
    lse = math.log(1 + math.e + math.e**2)
    assert (a.token_id, a.rank, a.top_ids) == (1, 2, [2]) and a.logprob == pytest.approx(1 - lse, abs=1e-6)
    assert (b.token_id, b.rank) == (0, 1) and b.logprob == pytest.approx(2 - lse, abs=1e-6)
    assert res.tokens == [0]


# ---------------------------------------------------------------------- bitmask kernel
@pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="native kernels not built")
def test_native_bitmask_kernel_matches_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    vocab = 32 * 9 + 5
    bm = torch.randint(-(2**31), 2**31 - 1, (4, 10), dtype=torch.int32, generator=g)
    bm[0, :3] = 0
    bm[1, :3] = -1  # all allowed
    x = torch.randn(4, vocab, generator=g)
    a, b = x.clone(), x.clone()
    xgr.apply_token_bitmask_inplace(a, bm, indices=[0, 1, 3])
    cpu_kernels.apply_token_bitmask_(b, bm, torch.tensor([0, 1, 3]))
    assert torch.equal(a, b) and torch.equal(b[2], x[2]) and bool(torch.isinf(b[0, :96]).all())
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.apply_token_bitmask_(b, bm, torch.tensor([4]))


def test_batched_fill_and_accept_equal_one_matcher_at_a_time():
    """fill_bitmasks (xgrammar's BatchGrammarMatcher) writes exactly the rows a per-matcher fill
    writes, at the given rows only; accept_tokens advances each matcher and refuses (unchanged)
    a token its grammar does not allow."""
    xgr = pytest.importorskip("xgrammar")
    from radixkv.sampling.grammar import GrammarState, accept_tokens, batch_matcher, fill_bitmasks

    vocab = ["a", "b", "c", "ab", "ba", "x", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[6])
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    grammars = [comp.compile_grammar(xgr.Grammar.from_regex(r)) for r in ("a+b", "(ab|ba)c", "x|c")]
    states = [GrammarState(xgr.GrammarMatcher(g)) for g in grammars]
    ref = [GrammarState(xgr.GrammarMatcher(g)) for g in grammars]
    rows, batch = [4, 0, 2], batch_matcher()
    for tokens in ([0, 3, 5], [1, 2, 6]):  # a | ab | x, then b | c | </s>
        bm = torch.full((5, 1), 7, dtype=torch.int32)
        fill_bitmasks(states, bm, rows, batch)
        want = torch.full((5, 1), 7, dtype=torch.int32)
        for st, r in zip(ref, rows):
            st.matcher.fill_next_token_bitmask(want, r)
        assert torch.equal(bm, want) and bm[1, 0] == 7 and bm[3, 0] == 7
        assert accept_tokens(states, tokens) == [True, True, True]
        assert [st.accept(t) for st, t in zip(ref, tokens)] == [True, True, True]
    assert [st.terminated for st in states] == [False, False, True]
    assert accept_tokens(states[:2], [5, 5]) == [False, False]  # "x" fits neither; both unchanged
    assert accept_tokens(states[:2], [6, 6]) == [True, True]  # both complete: EOS ends them
    assert [st.terminated for st in states] == [True, True, True]


# ---------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logprob_start_len": 3}, "logprob_start_len"),
        ({"logprob_start_len": -1, "prompt_logprobs": 0}, "logprob_start_len"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1]}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"grammar": 5}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": "yes"}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"structural_tag": "[]"}, "structural_tag"),
        ({"json_object": "yes"}, "json_object"),
        ({"regex": "a+", "choice": ["a"]}, "choice"),
        ({"json_object": True, "json_schema": {}}, "json_object"),
    ],
)
def test_new_fields_are_validated_and_name_the_field(kwargs, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and field in str(e.value)


def test_new_fields_normalize():
    p = SamplingParams(
        logit_bias={"7": 1, 3: -100}, prompt_logprobs=2, json_schema='{"type": "object", "b": 1, "a": 2}'
    )
    assert p.logit_bias == {7: 1.0, 3: -100.0}
    assert p.logprob_start_len == 0  # default with prompt_logprobs
    assert p.structured_output == ("json_schema", '{"type":"object","b":1,"a":2}')  # key order kept
    assert SamplingParams(json_schema={"type": "object", "b": 1, "a": 2}).structured_output == p.structured_output
    assert p.clone(prompt_logprobs=None).logprob_start_len is None
    assert SamplingParams(choice=("a", "b")).structured_output == ("choice", '["a", "b"]')
    assert SamplingParams(json_object=True).structured_output == ("json_object", "")
    assert SamplingParams().structured_output is None and not SamplingParams()._needs_pipeline


def test_tool_call_structural_tag_shape_and_errors():
    from radixkv.sampling.grammar import choice_ebnf, tool_call_structural_tag

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, {"name": "g"}]
    tag = tool_call_structural_tag(tools, parallel=False)
    fmt = tag["format"]
    assert tag["type"] == "structural_tag" and fmt["type"] == "tags_with_separator"
    assert fmt["at_least_one"] and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == [
        '<tool_call>\n{"name": "f", "arguments": ',
        '<tool_call>\n{"name": "g", "arguments": ',
    ]
    assert fmt["tags"][1]["content"]["json_schema"] == {"type": "object"}  # no parameters: any object
    assert [t["begin"] for t in tool_call_structural_tag(tools, name="g")["format"]["tags"]] == [
        '<tool_call>\n{"name": "g", "arguments": '
    ]
    for kw, field in (({"name": "h"}, "tool_choice"), ({}, "tools")):
        with pytest.raises(RequestError) as e:
            tool_call_structural_tag(tools if kw else [], **kw)
        assert e.value.param == field
    with pytest.raises(RequestError):
        tool_call_structural_tag([{"type": "function", "function": {}}])
    assert choice_ebnf(['a"b', "c\\d", "\t"]) == 'root ::= "a\\"b" | "c\\\\d" | "\\u0009"'


def test_extreme_temperatures_and_penalties_never_give_nan_probabilities():
    """A temperature under 1e-5 is greedy (vLLM's epsilon); a logit that overflows after scaling
    (a tiny repetition_penalty, a huge one / tiny temperature) keeps a defined draw; a row with
    no token left falls back to argmax. (A fuzzed body once stopped the engine here.)"""
    from radixkv.sampling.sampler import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4
    logits[2, 7] = float("inf")
    tiny = SamplingParams(temperature=1e-300)
    assert tiny.greedy and sample(logits[:1], [tiny], [None]) == [int(logits[0].argmax())]
    hot = SamplingParams(temperature=2e-5, seed=1)
    assert not hot.greedy
    got = sample(logits, [hot, SamplingParams(temperature=1.0, top_p=1e-9), hot], [None, None, None], g)
    assert got[0] == int(logits[0].argmax()) and got[1] == int(logits[1].argmax()) and got[2] == 7
    nan_row = torch.full((1, 50), float("nan"))
    nan_row[0, 3] = 1.0
    assert sample(nan_row, [SamplingParams(temperature=0.7)], [None], g) == [3]


def test_best_allowed_token_reads_the_bitmask():
    from radixkv.sampling.pipeline import _best_allowed

    row = torch.tensor([5.0, 9.0, float("nan"), 1.0] + [0.0] * 36)
    words = torch.zeros(2, dtype=torch.int32)
    words[0] = (1 << 0) | (1 << 3)
    words[1] = torch.tensor(-(2**31), dtype=torch.int32)  # bit 31 of word 1: token 63, beyond the row
    assert _best_allowed(row, words) == 0
    words[0] = 1 << 2  # only the NaN token: still allowed, the first allowed one
    assert _best_allowed(row, words) == 2
    assert _best_allowed(row, torch.zeros(2, dtype=torch.int32)) is None


def test_all_greedy_argmax_matches_torch_ties_nan_inf():
    """An all-greedy batch takes numpy's argmax of the rows: the same index as torch.argmax on
    ties (the first), NaN (the first NaN), all -inf, +inf ties, and random rows."""
    from radixkv.sampling.sampler import sample

    g = torch.Generator().manual_seed(0)
    rows = [
        [1.0, 3.0, 3.0, 2.0],
        [1.0, float("nan"), 5.0, float("nan")],
        [float("-inf")] * 4,
        [0.0, float("inf"), 1.0, float("inf")],
        [-0.0, 0.0, -1.0, 0.0],
    ]
    logits = torch.tensor(rows)
    params = [SamplingParams(temperature=0.0)] * len(rows)
    assert sample(logits, params, [None] * len(rows)) == torch.argmax(logits, dim=-1).tolist() == [1, 1, 0, 1, 0]
    big = torch.randn(7, 49152, generator=g)
    big[3, 100] = big[3, 40000] = big[3].max() + 1  # a tie far apart
    got = sample(big, [SamplingParams(temperature=0.0)] * 7, [None] * 7)
    assert got == torch.argmax(big, dim=-1).tolist() and got[3] == 100
    assert all(type(t) is int for t in got)
