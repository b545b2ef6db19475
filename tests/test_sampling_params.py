"""SamplingParams validation and the sampler's filters (CPU, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.sampling.sampler import draw, filter_logits, make_generator, sample
from radixkv.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_and_alias():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, -1, 0.0)
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.5).clone(seed=3).seed == 3


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_new_tokens": -1}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("key", ["\u0665", "\uff15", "\u0e55", " 5", "5\n"])
def test_a_logit_bias_key_other_than_ascii_digits_is_refused_naming_it(key):
    """A logit_bias key is a token id in decimal ASCII digits; str.isdigit / int() also read
    Arabic-Indic, fullwidth or Thai digits and surrounding whitespace, so {"\u0665": 100} silently
    biased token 5 (the reply was special tokens) instead of the 400 naming logit_bias."""
    with pytest.raises(ValueError, match="logit_bias keys must be token ids") as e:
        SamplingParams(logit_bias={key: 100})
    assert e.value.param == "logit_bias"
    assert SamplingParams(logit_bias={"5": 100, "-0": 1}).logit_bias == {5: 100.0, 0: 1.0}


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]])
    p = SamplingParams(temperature=0)
    assert sample(logits, [p, p], [None, None]) == [1, 0]


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda p: torch.isfinite(filter_logits(logits, p)).tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    # nucleus: 0.5 + 0.3 reaches 0.8, so 0.8 keeps two tokens and 0.81 keeps three
    assert keep(SamplingParams(top_p=0.8)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.81)) == [True, True, True, False]
    # min_p 0.2 of the top probability 0.5 is 0.1
    assert keep(SamplingParams(min_p=0.2)) == [True, True, True, False]
    out = filter_logits(logits, SamplingParams(top_k=2))
    assert torch.allclose(out[:2].exp(), torch.tensor([0.5, 0.3]) / 0.8)


def test_seeded_sampling_reproducible_and_filtered():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=5, seed=11)
    a = [sample(logits, [p] * 3, [make_generator(11, "cpu") for _ in range(3)]) for _ in range(2)]
    assert a[0] == a[1]
    top5 = torch.topk(logits, 5).indices.tolist()
    assert all(t in top5[i] for i, t in enumerate(a[0]))
    draws = {tuple(sample(logits, [p] * 3, [None] * 3)) for _ in range(20)}
    assert len(draws) > 1


def test_sample_length_mismatch():
    with pytest.raises(ValueError, match="same length"):
        sample(torch.zeros(2, 4), [SamplingParams()], [None])


@pytest.mark.parametrize("temperature, extra", [(0.7, {}), (1.3, {"top_k": 50}), (0.9, {"top_p": 0.8, "min_p": 0.02})])
def test_sampled_tokens_are_inverse_cdf_draws_of_one_variate(temperature, extra):
    """sample() draws each row as the first index whose float64 cumulative probability exceeds
    u * total, u one float64 uniform from the row's generator, and leaves the generator exactly
    one variate on (so a seeded request's later tokens, with or without speculative decoding,
    do not depend on the logits). Rows with filtered (-inf) tokens and a row with no token left
    (argmax, no draw) included. The reference is numpy's, computed apart from the sampler."""
    p = SamplingParams(temperature=temperature, seed=0, **extra)
    for s in range(40):
        g = torch.Generator().manual_seed(s)
        logits = torch.randn(3, 4096, generator=g) * (1 + s % 5)
        logits[1, : 64 * (s % 4)] = float("-inf")
        if s % 10 == 9:
            logits[2] = float("nan")
        ours = [torch.Generator().manual_seed(100 * s + i) for i in range(3)]
        ref = [torch.Generator().manual_seed(100 * s + i) for i in range(3)]
        want = []
        for i in range(3):
            probs = filter_logits(logits[i], p).exp().numpy().astype(np.float64)
            if not np.isfinite(probs).all() or not probs.sum() > 0:
                want.append(int(torch.argmax(torch.nan_to_num(logits[i], nan=float("-inf")))))
                continue
            cdf = np.cumsum(probs)
            u = float(torch.rand(1, dtype=torch.float64, generator=ref[i])) * cdf[-1]
            want.append(int(np.searchsorted(cdf, u, side="right")))
            assert probs[want[-1]] > 0
        assert sample(logits, [p] * 3, ours) == want, s
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, ref)), s


def test_draws_follow_the_distribution():
    """A chi-square goodness-of-fit test of 40,000 seeded draws against softmax(logits / T) on
    a small vocabulary with two filtered tokens, which are never drawn (df = 5; the 1e-6 tail of
    chi-square with 5 degrees of freedom is 35.9)."""
    logits = torch.tensor([2.0, 1.0, float("-inf"), 0.5, 0.0, -1.0, float("-inf"), 1.5])
    p = SamplingParams(temperature=0.8, seed=0)
    want = torch.softmax(logits / 0.8, dim=-1).numpy().astype(np.float64)
    n = 40_000
    gen = make_generator(5, "cpu")
    counts = np.bincount([sample(logits[None], [p], [gen])[0] for _ in range(n)], minlength=8)
    assert counts[2] == counts[6] == 0
    live = want > 0
    chi2 = float((((counts - n * want) ** 2)[live] / (n * want[live])).sum())
    assert chi2 < 35.9, (chi2, counts.tolist())


@pytest.mark.parametrize("u, want", [(1.0, 5), (0.0, 2)])
def test_draw_edges_never_pick_a_zero_probability_token(monkeypatch, u, want):
    """u * total rounding up to the total (u = 1 stands in) draws the last token of nonzero
    probability, not one past the end; u = 0 draws the first, skipping leading zeros."""
    cdf = torch.cumsum(torch.tensor([0.0, 0.0, 0.25, 0.25, 0.0, 0.5, 0.0]), 0, dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([u], dtype=torch.float64))
    assert draw(cdf, None) == want


def test_a_row_with_every_token_masked_takes_no_draw():
    """A row of -inf everywhere (every token masked) has no token left: the argmax fallback, and
    the row's generator is not advanced; one -inf token in an otherwise normal row is never drawn."""
    logits = torch.full((2, 64), float("-inf"))
    logits[1] = torch.randn(64, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = float("-inf")
    p = SamplingParams(temperature=1.0, seed=0)
    gens = [make_generator(1, "cpu"), make_generator(2, "cpu")]
    before = gens[0].get_state()
    draws = [sample(logits, [p, p], gens) for _ in range(200)]
    assert all(d[0] == 0 for d in draws)
    assert torch.equal(gens[0].get_state(), before)
    assert all(d[1] != 7 for d in draws)


@pytest.mark.parametrize(
    "name, hint",
    [
        ("best_of", "n samples"),
        ("guided_decoding", "json_schema="),
        ("structured_outputs", "json_schema="),
        ("logits_processors", "logit_bias"),
        ("bad_words", "not supported by radixkv"),
        ("truncate_prompt_tokens", "not supported by radixkv"),
        ("spaces_between_special_tokens", "not supported by radixkv"),
        ("temprature", "not supported by radixkv"),
    ],
)
def test_a_field_radixkv_lacks_is_a_value_error_naming_it(name, hint):
    """vLLM code passing a field radixkv does not implement gets a RequestError (a ValueError, as
    every other bad argument) naming it, not the dataclass's TypeError."""
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=0, **{name: 1})
    assert e.value.param == name
    assert f"does not take {name} " in str(e.value) and hint in str(e.value)
    assert "include_stop_str_in_output" in str(e.value)  # the fields it does take


def test_a_field_set_after_construction_is_validated_when_checked_and_an_unknown_one_refused():
    """vLLM code sets fields on a built SamplingParams (``sp.logit_bias = ...``): ``checked()``
    (what the engine submits) validates the current values; the flags derived at construction
    (processors, grammar) missed the change, so the field was silently ignored."""
    sp = SamplingParams(temperature=0, max_tokens=6)
    assert sp.checked() is sp
    sp.logit_bias = {"7": -100}
    sp.stop = "Paris"
    sp.json_object = True
    c = sp.checked()
    assert c is not sp and c.logit_bias == {7: -100.0} and c.stop == ["Paris"]
    assert c._uses_processors and c.structured_output == ("json_object", "")
    assert sp.stop == "Paris"  # the caller's object is left as it is
    for name, value in (("n", 0), ("max_tokens", 0), ("temperature", -5), ("min_tokens", 7)):
        bad = SamplingParams(max_tokens=6)
        setattr(bad, name, value)
        with pytest.raises(ValueError) as e:
            bad.checked()
        assert e.value.param == name
    sp = SamplingParams()
    sp.stop_token_ids = np.array([1, 2])  # compared elementwise: the bool of it raised
    with pytest.raises(ValueError, match="stop_token_ids must be a list"):
        sp.checked()
    sp = SamplingParams(prompt_logprobs=2)
    sp.prompt_logprobs = None  # its default logprob_start_len (0) goes with it
    assert sp.checked().logprob_start_len is None
    sp = SamplingParams()
    sp.max_new_tokens = 5  # the alias alone
    assert sp.checked().max_tokens == 5
    with pytest.raises(ValueError) as e:
        sp.best_of = 2
    assert e.value.param == "best_of" and "n samples" in str(e.value)


def test_numpy_scalars_are_taken_as_python_numbers_as_vllm_takes_them():
    """``max_tokens=np.int64(8)`` (a length computed with numpy) is an integer: it was refused
    with 'max_tokens must be ... an integer >= 1, got np.int64(8)' (token ids took numpy ints)."""
    sp = SamplingParams(
        n=np.int64(2),
        max_tokens=np.int32(8),
        temperature=np.float32(0.5),
        top_k=np.int8(5),
        seed=np.uint64(3),
        logit_bias={np.int64(7): np.float32(-1.5)},
    )
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_k, sp.seed, sp.logit_bias) == (2, 8, 0.5, 5, 3, {7: -1.5})
    assert [type(v) for v in (sp.n, sp.max_tokens, sp.temperature, sp.seed)] == [int, int, float, int]
    assert SamplingParams(output_kind=np.int64(1)).output_kind is RequestOutputKind.DELTA
    for kwargs, field in ((dict(n=np.bool_(True)), "n"), (dict(temperature=np.float32("nan")), "temperature")):
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == field


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_past_the_limit_is_a_value_error_naming_the_field(as_text):
    """A JSON schema nested 2,000 levels deep (a dict or its JSON text) raised RecursionError from
    ``SamplingParams(json_schema=...)`` (not a ValueError naming the field), and one a few hundred
    levels deep held the caller's thread in xgrammar's parse for seconds; the limit is
    MAX_SCHEMA_DEPTH levels of JSON nesting, the server's body parser refusing deeper bodies too."""
    from radixkv.errors import RequestError
    from radixkv.sampling_params import MAX_SCHEMA_DEPTH

    def nested(levels, text=as_text):  # `levels` JSON objects: arrays of arrays of ... of an integer
        if text:
            return '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)
        schema = {"type": "integer"}
        for _ in range(levels - 1):
            schema = {"type": "array", "items": schema}
        return schema

    ok = SamplingParams(json_schema=nested(MAX_SCHEMA_DEPTH))
    assert ok.structured_output[0] == "json_schema"
    for levels in (MAX_SCHEMA_DEPTH + 2, 2_000, 20_000):
        with pytest.raises(RequestError) as e:
            SamplingParams(json_schema=nested(levels))
        assert e.value.param == "json_schema" and f"at most {MAX_SCHEMA_DEPTH}" in str(e.value)
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": nested(2_000, False)}}
    with pytest.raises(RequestError) as e:
        SamplingParams(structural_tag=tag)
    assert e.value.param == "structural_tag" and f"at most {MAX_SCHEMA_DEPTH}" in str(e.value)
