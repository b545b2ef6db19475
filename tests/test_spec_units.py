"""The speculative-decoding package on its own (radixkv.spec): the config and its errors, prompt
lookup, the cross-request suffix index (bounded, namespaced), the adaptive draft length, the
drafter's sources (radix tree continuation, own sequence, siblings, suffix index; never another
namespace's text), grammar drafts (cut where the grammar refuses, forced spans added, matcher
restored), and the KV manager's tentative draft slots."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from radixkv.cache import RadixCache
from radixkv.config import EngineConfig
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams
from radixkv.spec import MAX_SPECULATIVE_TOKENS, SpeculativeConfig, parse_speculative_config
from radixkv.spec.adaptive import PROBE_EVERY, Acceptance
from radixkv.spec.drafter import TREE_RETRY, Drafter
from radixkv.spec.ngram import NgramIndex, best_continuation
from radixkv.spec.suffix import SuffixIndex


# ---------------------------------------------------------------------- config
def test_config_parses_dicts_json_and_none():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("null") is None
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 2, 4)
    assert parse_speculative_config(c) is c
    cfg = EngineConfig(device="cpu", speculative_config={"method": "radix"}).resolve()
    assert cfg.speculative_config == SpeculativeConfig("radix") and cfg.speculative_config.num_speculative_tokens == 5
    assert EngineConfig(device="cpu").resolve().speculative_config is None
    # "ngram" keeps no suffix index: 0 (off) and the default are consistent with it, so its
    # as_dict() parses back
    ng = SpeculativeConfig("ngram", suffix_index_tokens=0)
    assert parse_speculative_config(SpeculativeConfig("ngram").as_dict()) == SpeculativeConfig("ngram") != ng


@pytest.mark.parametrize(
    "value,field",
    [
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method is required"),
        ({"method": "radix", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "radix", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "from 1 to 16"),
        ({"method": "radix", "num_speculative_tokens": 2.0}, "speculative_config.num_speculative_tokens"),
        ({"method": "radix", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"method": "radix", "lookahead": 3}, "unknown key(s) ['lookahead']"),
        ({"method": "radix", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
        ({"method": "radix", "adaptive": 1}, "speculative_config.adaptive"),
        ({"method": "radix", "draft_row_cost": 0}, "speculative_config.draft_row_cost"),
        ("[1, 2]", "speculative_config must be None, a dict"),
        ("{not json", "speculative_config must be a JSON object"),
        ('{"method": "radix", "method": "ngram"}', "key 'method' given twice"),
        ('{"method": "radix", "num_speculative_tokens": 3, "num_speculative_tokens": 17}', "given twice"),
        ('"radix"', "its JSON text, got JSON text of a str"),
        ({"method": "ngram", "suffix_index_tokens": 1000}, "speculative_config.suffix_index_tokens applies to"),
        ({"method": "radix", "adaptive": False, "draft_row_cost": 0.5}, "speculative_config.draft_row_cost applies"),
    ],
)
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError) as e:
        EngineConfig(device="cpu", speculative_config=value).resolve()
    assert field in str(e.value)


# ---------------------------------------------------------------------- prompt lookup
def test_ngram_index_drafts_what_followed_the_longest_match():
    idx = NgramIndex(2)
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    prompt = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 8, 1, 2]
    idx.sync(prompt, [3])  # query ends ... 1, 2, 3: "2 3" at ends 2 and 6; "1 2 3" only at 2
    assert idx.suffix_key() == (2, 3)
    assert idx.ends((2, 3)) == [2, 6]
    match, draft = best_continuation(idx.tokens, [(idx.tokens, idx.ends((2, 3)))], 4, 8)
    assert (match, draft) == (3, [4, 9, 2, 3])
    idx.sync(prompt, [3, 4])  # the sequence grew: the index follows, positions stay
    assert idx.tokens[-2:] == [3, 4] and idx.ends((2, 3)) == [2, 6, 13]


def test_ngram_continuation_runs_on_through_a_repeating_pattern():
    idx = NgramIndex(2)
    idx.sync([7, 8, 9, 7, 8], [])
    match, draft = best_continuation(idx.tokens, [(idx.tokens, idx.ends((7, 8)))], 7, 8)
    assert (match, draft) == (2, [9, 7, 8, 9, 7, 8, 9])


def test_suffix_index_is_bounded_and_namespaced():
    a, b = Namespace(tenant="a"), Namespace(tenant="b")
    s = SuffixIndex(2, max_tokens=30)
    s.add(a, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert s.lookup(a, [50, 51, 3, 4], 3, 8) == (2, [5, 6, 7])
    assert s.lookup(b, [50, 51, 3, 4], 3, 8) == (0, [])  # another tenant's text never drafts
    assert s.lookup(None, [3, 4], 3, 8) == (0, [])
    s.add(b, [3, 4, 40, 41, 42] * 4)  # 20 tokens: 30 in all
    assert (len(s), s.size) == (2, 30)
    assert s.lookup(b, [9, 3, 4], 2, 8) == (2, [40, 41])
    s.add(b, list(range(100, 110)))  # 10 more: the oldest (a's) goes
    assert (len(s), s.size) == (2, 30)
    assert s.lookup(a, [3, 4], 3, 8) == (0, [])
    assert all(seq.namespace == b for seq, _ in (c for lst in s._keys.values() for c in lst))
    s.add(a, list(range(200, 300)))  # longer than the bound: its last 30 tokens, alone
    assert (len(s), s.size) == (1, 30)
    assert s.lookup(a, [270, 271], 2, 8) == (2, [272, 273])
    assert s.lookup(a, [269, 270], 2, 8) == (0, [])


# ---------------------------------------------------------------------- adaptive
def test_draft_length_follows_the_acceptance_rate():
    a = Acceptance()
    assert a.rate == 0.5 and a.draft_len(8, 0.25) == 2  # 0.5 ** 2 >= 0.25 > 0.5 ** 3
    a.update(2, 2, False)
    a.update(5, 5, False)
    assert a.rate > 0.9 and a.draft_len(8, 0.25) == 8
    a.update(8, 3, True)  # one edit in a long copy: still drafting long
    assert a.draft_len(8, 0.25) >= 4
    fails = 0
    while a.rate >= 0.25:  # the text stopped repeating: each verify rejects its first draft
        a.update(a.draft_len(8, 0.25), 0, True)
        fails += 1
    assert fails <= 6
    lens = [a.draft_len(8, 0.25) for _ in range(2 * PROBE_EVERY)]
    assert lens == ([0] * (PROBE_EVERY - 1) + [1]) * 2  # no drafting, a one-token probe every 8 steps
    a.update(1, 1, False)
    assert a.draft_len(8, 0.25) >= 1


def test_a_draft_row_costs_more_in_a_step_of_more_rows():
    from radixkv.spec.adaptive import row_cost_at

    assert row_cost_at(0.25, 1) == pytest.approx(0.25) and row_cost_at(0.25, 0) == pytest.approx(0.25)
    assert row_cost_at(0.25, 4) == pytest.approx(1 / 1.75)  # r = T0 / 3: 4 r / (T0 + 4 r)
    costs = [row_cost_at(0.25, b) for b in range(1, 65)]
    assert costs == sorted(costs) and costs[-1] < 1 and row_cost_at(1.0, 8) == 1.0
    a = Acceptance()  # a rate of 0.5: two tokens alone, none beside three other decode rows
    assert a.draft_len(5, row_cost_at(0.25, 1)) == 2 and a.draft_len(5, row_cost_at(0.25, 4)) == 0


# ---------------------------------------------------------------------- the drafter
class Req:
    """What the drafter reads of a request."""

    def __init__(self, prompt, output=(), namespace=None, max_tokens=100, sampling_state=None, rid="r"):
        self.request_id = rid
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)
        self.namespace = namespace
        self.params = SamplingParams(max_tokens=max_tokens)
        self.sampling_state = sampling_state
        self.spec_state = None
        self.draft_tokens = []


def _cache_with(seqs):
    cache = RadixCache(1)
    slot = 0
    for ns, toks in seqs:
        cache.insert(toks, torch.arange(slot, slot + len(toks)), ns)
        slot += len(toks)
    return cache


def test_radix_tree_continuation_is_the_draft_in_the_requests_namespace_only():
    a, b = Namespace(tenant="a"), Namespace(tenant="b")
    prev = list(range(10, 40))  # a cached conversation of tenant a
    cache = _cache_with([(a, prev)])
    d = Drafter(SpeculativeConfig("radix", num_speculative_tokens=4, adaptive=False), cache)
    mine, other = Req(prev[:12], prev[12:15], a), Req(prev[:12], prev[12:15], b)
    d.propose([mine, other], 4096)
    assert mine.draft_tokens == prev[15:19]
    assert other.draft_tokens == []  # the same tokens under another tenant: nothing
    before = (cache.evictable_size(), cache.protected_size())
    assert before == (30, 0)  # read-only: nothing locked


def test_tree_miss_waits_before_looking_again():
    cache = _cache_with([(None, list(range(10, 40)))])
    d = Drafter(SpeculativeConfig("radix", num_speculative_tokens=3, adaptive=False, suffix_index_tokens=0), cache)
    r = Req(list(range(10, 20)), [99])  # left the tree
    d.propose([r], 4096)
    assert r.draft_tokens == [] and r.spec_state.tree_wait == TREE_RETRY


def test_lookup_sources_own_sequence_siblings_and_suffix_index():
    cfg = SpeculativeConfig("radix", num_speculative_tokens=3, adaptive=False)
    d = Drafter(cfg, RadixCache(1))
    prompt = [5, 6, 7, 8, 9]
    # own sequence: "8 9" -> the prompt's "... 7 8" then? the output repeats the prompt's 6 7
    own = Req(prompt, [6, 7])
    d.propose([own], 4096)
    assert own.draft_tokens == [8, 9, 6]
    # siblings (same prompt, same namespace): one is ahead of the other
    s0, s1 = Req(prompt, [1, 2, 3, 4, 2, 3], rid="x"), Req(prompt, [1, 2], rid="x")
    d.propose([s0, s1], 4096)
    assert s1.draft_tokens == [3, 4, 2]
    s2 = Req(prompt, [1, 2], namespace="other", rid="y")  # same prompt, another namespace
    d.propose([s0, s2], 4096)
    assert s2.draft_tokens == []
    # the suffix index: a finished sequence of the namespace
    d.on_finished(Req([70, 71, 72, 73, 74, 75], [76, 77], namespace="n"))
    q = Req([1, 72, 73], namespace="n")
    d.propose([q], 4096)
    assert q.draft_tokens == [74, 75, 76]
    q2 = Req([1, 72, 73], namespace="m")
    d.propose([q2], 4096)
    assert q2.draft_tokens == []


def test_a_sample_far_ahead_of_its_slowest_sibling_does_not_draft():
    """The samples of an n > 1 request end together: a sample more than num_speculative_tokens
    output tokens ahead of its slowest decoding sibling drafts nothing (its rows would buy no
    time), one within that distance drafts, and the one ahead still serves as the laggard's
    source; other requests with the same prompt are not siblings."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False)
    d = Drafter(cfg)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    ahead = Req(prompt, [8, 9, 5, 6, 7, 8], rid="x")  # 6 tokens: 5 ahead of `slow` (> 3)
    near = Req(prompt, [8, 9, 5, 6], rid="x")  # 4 tokens: 3 ahead (not more than 3)
    slow = Req(prompt, [8], rid="x")
    other = Req(prompt, [8, 9, 5, 6, 7, 8], rid="y")  # the same progress, another request
    d.propose([ahead, near, slow, other], 4096)
    assert ahead.draft_tokens == []
    assert near.draft_tokens == [7, 8]  # the longest match: the sample ahead, which has drafted on to its end
    assert slow.draft_tokens == [9, 5, 6]
    assert other.draft_tokens == [9, 5, 6]
    assert ahead.spec_state.own.tokens == prompt + ahead.output_token_ids  # indexed for its siblings
    slow.output_token_ids += [9, 5, 6]  # the laggard caught up: the leader drafts again
    d.propose([ahead, near, slow], 4096)
    assert ahead.draft_tokens == [9, 5, 6] and slow.draft_tokens == [7, 8]


def test_drafts_stop_at_max_tokens_and_the_step_budget():
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=8, adaptive=False, max_draft_tokens_per_step=5)
    d = Drafter(cfg)
    p = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2]
    near_end = Req(p, [], max_tokens=3)  # 3 tokens to go: the bonus + 2 drafts
    d.propose([near_end], 4096)
    assert near_end.draft_tokens == [3, 4]
    r1, r2 = Req(p, []), Req(p + [3], [], rid="q")
    d.propose([r1, r2], 4096)
    assert len(r1.draft_tokens) + len(r2.draft_tokens) == 5
    r3 = Req(p, [])
    d.propose([r3], len(p) + 3)  # the context limit: 2 positions left before it
    assert r3.draft_tokens == [3, 4]


# ---------------------------------------------------------------------- grammar drafts
@pytest.fixture(scope="module")
def grammars():
    from model_helpers import tiny_loaded_model

    from radixkv.sampling.grammar import GrammarBackend

    tok = tiny_loaded_model().tokenizer
    return tok, GrammarBackend(tok, 49152, [tok.eos_token_id])


def test_grammar_cuts_refused_drafts_adds_forced_spans_and_restores_the_matcher(grammars):
    from radixkv.spec.grammar_drafts import grammar_draft

    tok, backend = grammars
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    compiled = backend.compile(("json_schema", json.dumps(schema))).result()
    st = backend.matcher(compiled)
    forced = grammar_draft(st.matcher, [], 8, True)
    # the forced span up to the space (a space token is a prefix of longer ones such as " 1")
    assert [tok.decode([t]) for t in forced] == ['{"', "answer", '":']
    enc = tok.encode('{"answer": 12}', add_special_tokens=False)
    assert grammar_draft(st.matcher, enc, 16, True) == enc  # every token allowed: kept
    assert grammar_draft(st.matcher, enc, 5, True) == enc[:5]
    bad = tok.encode('{"answer": "x"}', add_special_tokens=False)
    assert bad[:3] == enc[:3] and bad[3] != enc[3]
    assert grammar_draft(st.matcher, bad, 16, False) == enc[:3]  # cut before the refused ' "'
    no_space = tok.encode('{"answer":12}', add_special_tokens=False)
    assert grammar_draft(st.matcher, no_space, 16, True) == enc[:3]
    assert grammar_draft(st.matcher, [], 8, False) == []
    # the matcher is where it started: the same forced span again, its first token accepted
    assert grammar_draft(st.matcher, [], 8, True) == forced
    assert st.accept(forced[0]) and not st.terminated


def test_forced_text_is_drafted_as_the_tokenizer_splits_it(grammars):
    """The grammar allows every split of a forced key; the model writes its tokenizer's, so that
    is the draft (xgrammar's own is the longest token at each point)."""
    from radixkv.spec.grammar_drafts import grammar_draft

    tok, backend = grammars
    schema = {"type": "object", "properties": {"describes_topic": {"type": "string"}}, "required": ["describes_topic"]}
    st = backend.matcher(backend.compile(("json_schema", json.dumps(schema))).result())
    text = '{"describes_topic": "'
    encode = functools.partial(tok.encode, add_special_tokens=False)
    longest = grammar_draft(st.matcher, [], 16, True)
    split = grammar_draft(st.matcher, [], 16, True, encode)
    assert split == encode(text) and tok.decode(split) == text
    assert split != longest and tok.decode(longest) == text[: len(tok.decode(longest))]
    assert grammar_draft(st.matcher, [], 3, True, encode) == split[:3]
    assert st.accept(split[0]) and not st.terminated  # the matcher was restored


def test_forced_tokens_are_drafted_on_their_own_acceptance_rate(grammars):
    """A request whose looked-up drafts fail (free text) stops looking up, but still drafts the
    keys and punctuation its grammar forces: the two parts keep apart acceptance rates."""
    from types import SimpleNamespace

    tok, backend = grammars
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    st = backend.matcher(backend.compile(("json_schema", json.dumps(schema))).result())
    d = Drafter(SpeculativeConfig("ngram", num_speculative_tokens=5))
    r = Req([1, 2, 3, 1, 2], sampling_state=SimpleNamespace(grammar=st))
    r.params = SamplingParams(max_tokens=100)
    forced = tok.encode('{"answer":', add_special_tokens=False)
    d.propose([r], 4096)  # both rates start at 0.5: up to 2 tokens each; the lookup's are refused
    assert r.draft_tokens == forced[:2] and r.spec_state.n_free == 0
    ss = r.spec_state
    for _ in range(6):  # looked-up drafts keep failing: their rate falls below the row cost
        ss.n_free = 2
        d.observe(r, 2, 0, True)
    assert ss.acceptance.draft_len(5, 0.25) == 0 and ss.forced.rate == 0.5
    d.propose([r], 4096)
    assert r.draft_tokens == forced[:2] and r.spec_state.n_free == 0  # the forced part only
    d.observe(r, 2, 2, False)  # taken: the forced rate rises, the looked-up one is untouched
    assert ss.forced.rate > 0.5 and ss.acceptance.rate < 0.25
    before = (ss.forced.accepted, ss.forced.compared)
    ss.n_free = 1
    d.observe(r, 3, 0, True)  # the looked-up token refused: the forced two were never compared
    assert (ss.forced.accepted, ss.forced.compared) == before


# ---------------------------------------------------------------------- tentative slots
def test_kv_manager_reserves_and_settles_draft_slots():
    from radixkv.engine.kv_manager import KVManager
    from radixkv.engine.request import Request
    from radixkv.memory.allocator import SlotAllocator
    from radixkv.memory.kv_pool import ReqToTokenPool

    ps = 4
    kv = KVManager(RadixCache(ps), SlotAllocator(32, ps), ReqToTokenPool(4, 64))
    r = Request("a", 0, list(range(1, 10)), SamplingParams())
    prefix = kv.lock_prefix(r)
    kv.admit(r, prefix, 9)
    r.kv_len = 9
    r.output_token_ids.append(50)  # decoding: position 9 next
    kv.grow(r, 10)
    assert len(r.slots) == 12
    assert kv.reserve_drafts(r, 5) == 5  # positions 10..14: pages up to 16
    assert len(r.slots) == 16 and len(kv.drafts) == 1
    with pytest.raises(AssertionError, match="tentative draft slots"):
        kv.check_integrity([r])
    r.output_token_ids += [60, 61, 62]  # two drafts accepted and the bonus token sampled
    r.kv_len = 12  # positions 10, 11 computed for real; 12 (the bonus) next
    kv.settle_drafts(r)
    assert len(r.slots) == 12 and len(kv.drafts) == 0 and kv.free_size() == 32 - 12
    kv.check_integrity([r])
    # memory short: fewer drafts, never a failure
    other = kv.allocator.alloc(12)
    kv.grow(r, 13)  # the next decode's position first (the scheduler's order)
    assert kv.free_size() == 4 and len(r.slots) == 16
    assert kv.reserve_drafts(r, 8) == 7  # positions 13..19: the one free page
    assert len(r.slots) == 20 and kv.free_size() == 0
    r.kv_len = 12
    kv.release(r)  # the request ends inside its draft: everything goes back
    assert len(kv.drafts) == 0
    kv.allocator.free(other)
    kv.check_integrity([])
    assert kv.free_size() + kv.cache.total_size() == 32
