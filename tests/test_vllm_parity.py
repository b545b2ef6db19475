"""vLLM parity of the offline API: code ported from vLLM gets what vLLM documents.

Stop conditions (vLLM v1's detokenizer and ``check_stop``): a sample that ends on a stop token
(``stop_token_ids``, EOS, a grammar's end) keeps the token in ``token_ids`` but not its text in
``text`` unless ``include_stop_str_in_output``; ``stop_reason`` is the matched stop string or
``stop_token_ids`` entry, None for EOS; ``include_stop_str_in_output`` keeps a matched stop string.
Greedy token ids are checked against transformers' ``generate``."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.errors import RequestError  # noqa: E402

pytestmark = pytest.mark.timeout(600)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def offline(default_model):
    return LLM(device="cpu", loaded_model=default_model, max_total_tokens=4096)


@pytest.fixture(scope="module")
def greedy_ref(offline, hf_default):
    """transformers' greedy continuation of ``PROMPT`` (12 tokens, EOS not special-cased)."""
    ids = offline.tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = hf_default.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0
        )
    return ids, out[0, len(ids) :].tolist()


def _one(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_stop_token_id_text_excluded_unless_include_stop_str(offline, greedy_ref):
    _, ref = greedy_ref
    tok = offline.tokenizer
    stop = ref[2]  # "\n" after " Paris."
    c = _one(offline, PROMPT, max_tokens=12, stop_token_ids=[stop])
    assert c.token_ids == ref[:3]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == tok.decode(ref[:2]) == " Paris."
    kept = _one(offline, PROMPT, max_tokens=12, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept.token_ids == ref[:3] and kept.text == tok.decode(ref[:3]) == " Paris.\n"


def test_eos_stop_reason_is_none_and_its_text_is_excluded(offline):
    chat = [{"role": "user", "content": "Say hi."}]
    eos = offline.tokenizer.eos_token_id
    c = offline.chat(chat, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False), use_tqdm=False)
    c = c[0].outputs[0]
    assert c.token_ids[-1] == eos and (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.text == offline.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=False)
    assert not c.text.endswith("<|im_end|>")
    # EOS listed in stop_token_ids too: the user's stop token, reported as such
    c2 = offline.chat(chat, SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[eos]), use_tqdm=False)
    assert (c2[0].outputs[0].finish_reason, c2[0].outputs[0].stop_reason) == ("stop", eos)


def test_include_stop_str_in_output_keeps_the_stop_string(offline, greedy_ref):
    _, ref = greedy_ref
    full = offline.tokenizer.decode(ref)
    assert full.startswith(" Paris.\n\nThe")
    c = _one(offline, PROMPT, max_tokens=12, stop=["The"])
    assert (c.text, c.finish_reason, c.stop_reason) == (" Paris.\n\n", "stop", "The")
    k = _one(offline, PROMPT, max_tokens=12, stop=["The"], include_stop_str_in_output=True)
    assert (k.text, k.finish_reason, k.stop_reason) == (" Paris.\n\nThe", "stop", "The")
    assert k.token_ids == c.token_ids == ref[: len(c.token_ids)]


@pytest.mark.parametrize("include", [False, True])
def test_a_resumed_request_ending_on_a_stop_token_gives_the_uninterrupted_text(include):
    """The router's Stitcher (a request resumed on another replica) leaves the stop token's text
    out (or keeps it) exactly as the engine does for an uninterrupted run."""
    from test_routing import _char_engine, _resumed, _same_output, _stream

    prompt = [5, 9, 2, 33, 17, 8, 41, 3]
    free = list(_stream(_char_engine(), prompt, SamplingParams(temperature=0.0, max_tokens=40)))[-1]
    stop = free.outputs[0].token_ids[14]
    assert stop not in free.outputs[0].token_ids[:14]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], include_stop_str_in_output=include)
    ref = list(_stream(_char_engine(), prompt, params))
    final = ref[-1].outputs[0]
    assert (final.token_ids, final.finish_reason, final.stop_reason) == (free.outputs[0].token_ids[:15], "stop", stop)
    assert final.text == free.outputs[0].text[: 15 if include else 14]
    delivered = next(o for o in ref if len(o.outputs[0].token_ids) >= 10)
    plan, outs = _resumed(prompt, params, delivered, _char_tokenizer())
    assert plan == "continue"
    _same_output(outs[-1], ref[-1])


def _char_tokenizer():
    from test_scheduler import CharTokenizer

    return CharTokenizer()


def test_get_tokenizer_as_vllm_code_calls_it(offline, default_model):
    import asyncio

    from radixkv import AsyncLLM

    tok = offline.get_tokenizer()
    assert tok is offline.tokenizer
    assert tok.encode(PROMPT) == [504, 3575, 282, 4649, 314]
    alm = AsyncLLM(device="cpu", loaded_model=default_model, max_total_tokens=1024)
    try:
        assert asyncio.run(alm.get_tokenizer()) is alm.tokenizer
    finally:
        alm.shutdown()


def test_get_default_sampling_params_is_a_fresh_copy_of_what_generate_uses(offline, greedy_ref):
    """vLLM's ``LLM.get_default_sampling_params()`` (code reads it, changes a field, passes it
    on): radixkv reads no ``generation_config.json``, so it is ``SamplingParams()``, the params of
    ``generate(sampling_params=None)``, a new object per call. It was an AttributeError."""
    a, b = offline.get_default_sampling_params(), offline.get_default_sampling_params()
    assert a is not b and a == SamplingParams() and type(a) is SamplingParams
    got = (a.n, a.max_tokens, a.temperature, a.top_p, a.top_k, a.min_p, a.repetition_penalty, a.presence_penalty,
           a.frequency_penalty, a.min_tokens, a.seed, a.stop, a.logprobs)  # fmt: skip
    assert got == (1, 16, 1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 0, None, [], None)
    a.temperature, a.max_tokens = 0.0, 12
    assert (b.temperature, b.max_tokens) == (1.0, 16)  # a's changes are a's only
    assert offline.get_default_sampling_params() == SamplingParams()
    out = offline.generate(PROMPT, a, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ref[1]


def test_chat_continue_final_message_chat_template_and_kwargs(offline, hf_default):
    """vLLM's ``LLM.chat`` arguments: the prompt is transformers' ``apply_chat_template`` with
    the same options, and the greedy continuation is transformers' ``generate``."""
    tok = offline.tokenizer
    conv = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    ref_ids = tok.apply_chat_template(conv, continue_final_message=True, tokenize=True, return_dict=False)
    assert tok.decode(ref_ids).endswith("<|im_start|>assistant\nMy favourite color is")
    with torch.no_grad():
        ref = hf_default.generate(torch.tensor([ref_ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = offline.chat(
        conv,
        SamplingParams(temperature=0, max_tokens=6),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert out.prompt_token_ids == list(ref_ids)
    assert out.outputs[0].token_ids == ref[0, len(ref_ids) :].tolist()
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt") as e:
        offline.chat(conv, continue_final_message=True, use_tqdm=False)
    assert e.value.param == "continue_final_message"
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ suffix }}"
    out = offline.chat(
        conv[:1],
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"suffix": "Answer:"},
    )[0]
    assert out.prompt == "[user] Name a color.\nAnswer:"
    assert out.prompt_token_ids == tok.encode("[user] Name a color.\nAnswer:")
    for kw, param in (
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"chat_template": ""}, "chat_template"),
    ):
        with pytest.raises(ValueError) as e:
            offline.chat(conv[:1], use_tqdm=False, **kw)
        assert e.value.param == param


def test_chat_template_kwargs_documents_reach_the_template_as_in_vllm(offline):
    """vLLM passes ``chat_template_kwargs={"documents": [...]}`` to transformers'
    ``apply_chat_template`` (a RAG template renders them). It was refused with 'give them as
    LLM.chat's own arguments', and LLM.chat has no such argument."""
    template = (
        "{% for d in documents %}<doc {{ d.title }}>{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    conv = [{"role": "user", "content": "Q?"}]
    kw = {"chat_template": template, "chat_template_kwargs": {"documents": docs}}
    out = offline.chat(conv, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, **kw)[0]
    assert out.prompt == "<doc a><doc b>Q?"


def test_max_tokens_none_runs_to_the_end_of_the_context(default_model, hf_default):
    """vLLM's ``max_tokens=None``: up to the context length (here also the KV pool's size); the
    tokens are transformers' greedy ones, and the caller's SamplingParams is not changed."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    assert params.max_tokens is None and SamplingParams(max_tokens=None, min_tokens=50).min_tokens == 50
    ids = [504, 3575, 282, 4649, 314]
    with torch.no_grad():
        ref = hf_default.generate(torch.tensor([ids]), max_new_tokens=27, do_sample=False, eos_token_id=[])
    short = LLM(device="cpu", loaded_model=default_model, max_total_tokens=1024, max_context_len=32)
    c = short.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert (len(c.token_ids), c.finish_reason) == (27, "length")
    assert c.token_ids == ref[0, len(ids) :].tolist()
    assert params.max_tokens is None
    small_pool = LLM(device="cpu", loaded_model=default_model, max_total_tokens=24, max_context_len=64)
    c = small_pool.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert (len(c.token_ids), c.finish_reason) == (19, "length")
    with pytest.raises(ValueError) as e:
        short.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=None, min_tokens=28), use_tqdm=False)
    assert e.value.param == "min_tokens"


def test_use_tqdm_takes_a_bar_factory_as_vllm_does(offline):
    """``use_tqdm`` may be a callable that makes the bar (vLLM); it was silently replaced by
    radixkv's own bar. Anything but a bool or a callable is refused, naming ``use_tqdm``."""
    made = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.closed, self.kw = total, 0, False, kw
            made.append(self)

        def update(self, k=1):
            self.n += k

        def close(self):
            self.closed = True

    outs = offline.generate([PROMPT, "Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=Bar)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    assert [(b.total, b.n, b.closed) for b in made] == [(2, 2, True)]
    offline.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=Bar)
    assert [(b.total, b.n, b.closed) for b in made[1:]] == [(1, 1, True)]
    with pytest.raises(ValueError) as e:
        offline.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm="yes")
    assert e.value.param == "use_tqdm"
    assert offline.num_unfinished_requests() == 0


def test_allowed_token_ids_restricts_greedy_to_transformers_argmax_over_them(offline, hf_default):
    """vLLM's ``allowed_token_ids``: every step's token is the argmax of transformers' logits over
    the allowed ids only; logprobs stay the raw model's (vLLM's default ``raw_logprobs``)."""
    ids = offline.tokenizer.encode(PROMPT)
    allowed = [260, 28, 30, 2, 198]  # " the", ",", ".", EOS, "\n"
    ref, seq = [], list(ids)
    with torch.no_grad():
        for _ in range(5):
            logits = hf_default(torch.tensor([seq])).logits[0, -1]
            t = allowed[int(torch.argmax(logits[allowed]))]
            ref.append(t)
            seq.append(t)
    params = SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=allowed, ignore_eos=True, logprobs=1)
    c = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ref
    assert c.logprobs[0][7042].rank == 1  # " Paris", the model's choice, refused here
    for bad, where in (([], "allowed_token_ids"), ([-1], "allowed_token_ids"), ((1, "2"), "allowed_token_ids")):
        with pytest.raises(ValueError) as e:
            SamplingParams(allowed_token_ids=bad)
        assert e.value.param == where
    with pytest.raises(ValueError, match=r"allowed_token_ids holds 49152, outside the vocabulary \[0, 49152\)"):
        offline.generate(PROMPT, SamplingParams(allowed_token_ids=[5, 49152]), use_tqdm=False)
    assert offline.num_unfinished_requests() == 0


def test_async_abort_takes_a_list_of_request_ids(default_model):
    """vLLM's ``AsyncLLM.abort`` takes one id or several (``str | Iterable[str]``); a list raised
    ``TypeError: unhashable type: 'list'`` from the engine thread, and an iterable other than a
    list, tuple or set (a generator, ``dict.keys()``) was refused as not a str."""
    import asyncio

    from radixkv import AsyncLLM

    async def run(alm):
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        streams = [alm.generate(PROMPT, params, request_id=f"r{i}") for i in range(3)]
        iters = [s.__aiter__() for s in streams]
        firsts = [await it.__anext__() for it in iters]
        assert [f.finished for f in firsts] == [False] * 3
        await alm.abort(["r0", "r2"])
        for rest in ([o async for o in iters[0]], [o async for o in iters[2]]):
            assert [o.finished for o in rest][-1:] == [True] and not any(o.finished for o in rest[:-1])
            assert rest[-1].outputs[0].finish_reason == "abort"
        await alm.abort(rid for rid in {"r1": iters[1]}.keys())
        rest1 = [o async for o in iters[1]]
        assert rest1[-1].finished and rest1[-1].outputs[0].finish_reason == "abort"
        for bad in (7, [7], b"r1", ["r1", None]):
            with pytest.raises(ValueError) as e:
                await alm.abort(bad)
            assert e.value.param == "request_id"
        await alm.abort("r1")  # finished: a no-op
        return await alm.call_in_engine_thread(lambda e: (e.num_unfinished_requests(), e.cache_stats()["in_use"]))

    alm = AsyncLLM(device="cpu", loaded_model=default_model, max_total_tokens=2048)
    try:
        assert asyncio.run(run(alm)) == (0, 0)
    finally:
        alm.shutdown()


def test_detokenize_false_returns_token_ids_only(offline, greedy_ref):
    """vLLM's ``detokenize=False``: the same tokens, no text, no ``decoded_token`` (also in prompt
    logprobs); stop tokens still stop, stop strings are refused (they need the text)."""
    ids, ref = greedy_ref
    params = SamplingParams(temperature=0, max_tokens=12, detokenize=False, logprobs=1, prompt_logprobs=1)
    o = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    c = o.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == (ref, "", "length")
    assert all(lp.decoded_token is None for pos in c.logprobs for lp in pos.values())
    assert all(lp.decoded_token is None for pos in o.prompt_logprobs[1:] for lp in pos.values())
    assert c.logprobs[0][ref[0]].rank == 1
    s = _one(offline, PROMPT, max_tokens=12, detokenize=False, stop_token_ids=[ref[2]])
    assert (s.token_ids, s.text, s.finish_reason, s.stop_reason) == (ref[:3], "", "stop", ref[2])
    with pytest.raises(ValueError, match="detokenize=True") as e:
        SamplingParams(detokenize=False, stop=["The"])
    assert e.value.param == "stop"
    with pytest.raises(ValueError) as e:
        SamplingParams(detokenize=0)
    assert e.value.param == "detokenize"


def test_min_tokens_a_stop_string_counts_only_after_the_first_min_tokens(offline, greedy_ref):
    """vLLM v1: text of the first ``min_tokens`` tokens never ends the sample on a stop string
    (the string must end in a later token). Greedy: ' Paris', '.', '\\n', '\\n', 'The', ..."""
    _, ref = greedy_ref
    assert ref[2] == ref[3] == 198
    c = _one(offline, PROMPT, max_tokens=12, stop=["\n"], min_tokens=3)
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (ref[:4], " Paris.\n", "stop", "\n")
    c = _one(offline, PROMPT, max_tokens=12, stop=["\n"], min_tokens=2)
    assert (c.token_ids, c.text, c.stop_reason) == (ref[:3], " Paris.", "\n")
    # the '.' of token 2 lies wholly in the min_tokens text: a longer stop string beside it must not
    # make the look-back find it once checking starts (the 12 tokens have no other '.')
    c = _one(offline, PROMPT, max_tokens=12, stop=[".", "XYZW"], min_tokens=3)
    assert (c.token_ids, c.finish_reason, c.text) == (ref, "length", offline.tokenizer.decode(ref))
    assert c.text.count(".") == 1


def test_a_stop_string_held_back_with_an_incomplete_character_still_stops(offline):
    """Token 10003 is the Cyrillic 'о' and the first byte of another character, so its text is
    held back until a next token completes it. When the sample ended there (a stop token next,
    or max_tokens), the held text was flushed without the stop-string check (stop token) or with
    its finding dropped (length): stop=['о'] gave the text 'о\ufffd' with stop_reason 30, or the
    text '' with finish_reason 'length' and no stop_reason."""
    tok = offline.tokenizer
    assert tok.decode([10003]) == "о\ufffd" and tok.decode([30]) == "."
    prompt, only = "Привет, как дела? Хорош", dict(allowed_token_ids=[10003, 30], presence_penalty=2.0)
    free = _one(offline, prompt, max_tokens=2, **only)
    assert free.token_ids == [10003, 30] and free.text == "о\ufffd."
    c = _one(offline, prompt, max_tokens=4, **only, stop_token_ids=[30], stop=["о"])
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([10003, 30], "", "stop", "о")
    kept = _one(offline, prompt, max_tokens=4, **only, stop_token_ids=[30], stop=["о"],
                include_stop_str_in_output=True)  # fmt: skip
    assert (kept.text, kept.stop_reason) == ("о", "о")
    c = _one(offline, prompt, max_tokens=1, **only, stop=["о"])
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([10003], "", "stop", "о")
    # no stop string in the held text: the stop token's reason, the flushed text as before
    c = _one(offline, prompt, max_tokens=4, **only, stop_token_ids=[30], stop=["x"])
    assert (c.token_ids, c.text, c.stop_reason) == ([10003, 30], "о\ufffd", 30)
    # a stop string in the first min_tokens tokens does not count (vLLM v1), held back or not
    c = _one(offline, prompt, max_tokens=1, **only, stop=["о"], min_tokens=1)
    assert (c.text, c.finish_reason, c.stop_reason) == ("о\ufffd", "length", None)


def test_a_field_set_on_built_params_takes_effect_as_in_vllm(offline):
    """``sp.logit_bias = {...}`` / ``sp.n = 0`` on a built SamplingParams: the ban applies (the
    same tokens as built with it) and the bad n is a ValueError naming it. Before, the bias was
    silently ignored (greedy " Paris" came out) and n=0 crashed the engine's step with an
    IndexError."""
    built = _one(offline, PROMPT, max_tokens=4, logit_bias={7042: -100})
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.logit_bias = {7042: -100}
    c = offline.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == built.token_ids and 7042 not in c.token_ids
    sp.n = 0
    with pytest.raises(ValueError) as e:
        offline.generate(PROMPT, sp, use_tqdm=False)
    assert e.value.param == "n"
    assert offline.num_unfinished_requests() == 0


def test_lora_request_and_priority_at_their_defaults_run_as_in_vllm(offline):
    """vLLM code passes ``lora_request=None`` (and ``priority``) to generate / chat: taken at the
    defaults (it was a TypeError), any other value a RequestError naming it."""
    import numpy as np

    sp = SamplingParams(max_tokens=2, temperature=0)
    plain = offline.generate("Hi", sp)[0].outputs[0].token_ids
    assert offline.generate("Hi", sp, lora_request=None, priority=None)[0].outputs[0].token_ids == plain
    assert offline.generate("Hi", sp, priority=0)[0].outputs[0].token_ids == plain
    # vLLM's LLM.generate takes priority as a list, one per prompt (priority[i]): all 0 is its default
    both = offline.generate(["Hi", "Hi"], sp, priority=[0, 0])
    assert [o.outputs[0].token_ids for o in both] == [plain, plain]
    assert offline.generate(["Hi"], sp, priority=(np.int64(0),))[0].outputs[0].token_ids == plain  # numpy's 0 too
    chat = [{"role": "user", "content": "Hi"}]
    assert (
        offline.chat(chat, sp, lora_request=None)[0].outputs[0].token_ids
        == offline.chat(chat, sp)[0].outputs[0].token_ids
    )
    for kw, field in (
        ({"lora_request": object()}, "lora_request"),
        ({"priority": [1]}, "priority"),
        ({"priority": [0, 1]}, "priority"),
        ({"priority": [False]}, "priority"),
        ({"priority": True}, "priority"),
    ):
        with pytest.raises(RequestError, match=f"^{field} is not supported") as e:
            offline.generate("Hi", sp, **kw)
        assert e.value.param == field
    with pytest.raises(RequestError, match="^lora_request is not supported"):
        offline.chat(chat, sp, lora_request="adapter")
    with pytest.raises(RequestError, match="^priority has 1 entry for 2 prompts") as e:
        offline.generate(["Hi", "Hi"], sp, priority=[0])
    assert e.value.param == "priority"
    assert offline.num_unfinished_requests() == 0


def test_async_generate_takes_lora_request_and_priority_at_their_defaults(default_model):
    """vLLM's ``AsyncLLM.generate(..., lora_request=None, priority=0)``: taken (a TypeError before);
    another value is a RequestError naming it, raised by the first ``__anext__`` as every refusal."""
    import asyncio

    from radixkv import AsyncLLM

    params = SamplingParams(temperature=0, max_tokens=2)

    async def run(alm):
        outs = [o async for o in alm.generate("Hi", params, "a")]
        same = [o async for o in alm.generate("Hi", params, "b", lora_request=None, priority=0)]
        assert same[-1].outputs[0].token_ids == outs[-1].outputs[0].token_ids
        for kw, field in (({"lora_request": "adapter"}, "lora_request"), ({"priority": 2}, "priority")):
            stream = alm.generate("Hi", params, "c", **kw)  # nothing raised until iterated
            with pytest.raises(RequestError, match=f"^{field} is not supported") as e:
                await stream.__aiter__().__anext__()
            assert e.value.param == field
        return await alm.call_in_engine_thread(lambda e: e.num_unfinished_requests())

    alm = AsyncLLM(device="cpu", loaded_model=default_model, max_total_tokens=2048)
    try:
        assert asyncio.run(run(alm)) == 0
    finally:
        alm.shutdown()
