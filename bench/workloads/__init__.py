"""Seeded, reproducible prefix-caching workloads built from ShareGPT token ids.

Every generator returns a :class:`Workload`: requests in arrival order, each with its prompt
token ids, the reply token ids the cache-only simulation pretends were generated, and optionally
a ``parent``: then the request's full prompt is ``parent's full prompt + parent's output +
prompt`` (the output being ``reply`` in the simulation and the generated tokens end to end), so
follow-ups can build on what a model actually produced. All text is real ShareGPT text tokenized
with the default model's tokenizer (see :mod:`bench.workloads.sharegpt`), framed with SmolLM2's
ChatML chat template where the workload is a chat.

Workloads:

* ``multi_turn`` -- ShareGPT conversations replayed turn by turn: turn *t*'s prompt is the chat
  template of the whole history (with the dataset's gpt replies, also end to end:
  ``params["history"] == "dataset"``) + the next user message, its reply is the dataset's gpt
  turn; each turn is stored as the suffix after its parent (the previous turn). Conversations start in a seeded random order and at most
  ``concurrency`` are open at once; each next request comes from a random open conversation.
* ``few_shot`` -- one k-shot chat history (k ShareGPT question/answer pairs, truncated) shared by
  ``n`` distinct questions (an MMLU-style 5-shot prompt built from ShareGPT text).
* ``gsp`` -- SGLang's generated-shared-prefix shape: ``groups`` x ``prompts_per_group`` prompts;
  each group shares a long system prompt, each prompt adds a distinct question; arrival order is
  shuffled across groups.
* ``fork`` -- ``roots`` prompts, each continued ``branches`` times (same prompt, different
  replies), then one follow-up question per branch on top of that branch's reply (a root's
  follow-ups arrive right after its branches).
* ``unique`` -- raw ShareGPT messages with no template and no shared text: the floor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

__all__ = [
    "WorkloadRequest",
    "Workload",
    "WORKLOADS",
    "multi_turn",
    "few_shot",
    "gsp",
    "fork",
    "unique",
    "make_workload",
]


@dataclass
class WorkloadRequest:
    """One request. ``prompt``: token ids (the suffix after the parent's output if ``parent`` is
    set); ``reply``: output token ids assumed by the simulation; ``parent``: index of an earlier
    request or None; ``seed``: sampling seed for end-to-end runs (distinct branches)."""

    prompt: list[int]
    reply: list[int]
    parent: int | None = None
    namespace: Hashable = None
    seed: int = 0


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    params: dict[str, Any] = field(default_factory=dict)

    def full_prompt(self, i: int, outputs: dict[int, list[int]] | None = None) -> list[int]:
        """Request ``i``'s complete prompt token ids; ``outputs[j]`` overrides request ``j``'s
        ``reply`` as its generated output (end to end)."""
        chain = [i]
        while self.requests[chain[-1]].parent is not None:
            chain.append(self.requests[chain[-1]].parent)
        out: list[int] = []
        for j in reversed(chain):
            if j != i:
                out += self.requests[j].prompt
                out += outputs[j] if outputs is not None and j in outputs else self.requests[j].reply
            else:
                out += self.requests[j].prompt
        return out

    def stages(self) -> list[list[int]]:
        """Request indices grouped so that every parent is in an earlier stage."""
        depth: dict[int, int] = {}
        for i, r in enumerate(self.requests):
            depth[i] = 0 if r.parent is None else depth[r.parent] + 1
        out: list[list[int]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
        for i in range(len(self.requests)):
            out[depth[i]].append(i)
        return out


def _data():
    from bench.workloads.sharegpt import load_conversations

    return load_conversations()


def _chat(frame, turns: list[list[int]], gen_prompt: bool = True) -> list[int]:
    """ChatML token ids: default system block + alternating user/assistant messages."""
    out = list(frame["system"])
    for k, content in enumerate(turns):
        out += frame["user" if k % 2 == 0 else "assistant"] + content + frame["end"]
    if gen_prompt:
        out += frame["assistant"]
    return out


def multi_turn(
    n_conversations: int = 17318,
    concurrency: int = 1024,
    max_turns: int | None = None,
    max_context: int | None = None,
    reply_cap: int | None = None,
    seed: int = 0,
    data=None,
) -> Workload:
    """ShareGPT multi-turn replay (see module docstring). ``max_context`` drops a conversation's
    turns once the prompt + reply would exceed it; ``reply_cap`` truncates replies."""
    convs, frame = data or _data()
    rng = random.Random(seed)
    order = list(range(len(convs)))
    rng.shuffle(order)
    order = order[:n_conversations]
    eos = frame["eos"]
    per_conv: list[list[WorkloadRequest]] = []
    for ci in order:
        msgs = convs[ci]
        reqs: list[WorkloadRequest] = []
        length = 0
        for t in range(0, len(msgs), 2):
            if max_turns is not None and t // 2 >= max_turns:
                break
            user, reply = msgs[t], msgs[t + 1]
            if reply_cap is not None:
                reply = reply[:reply_cap]
            if t == 0:  # system block + first user message + generation prompt
                suffix = _chat(frame, [user])
            else:  # "\n" closing the previous reply's "<|im_end|>", next user message
                suffix = frame["end"][1:] + frame["user"] + user + frame["end"] + frame["assistant"]
            length += len(suffix)
            if max_context is not None and length + len(reply) + 1 > max_context:
                break
            # parent: local turn index here, made global when the conversations are interleaved
            reqs.append(
                WorkloadRequest(suffix, list(reply) + eos, parent=(len(reqs) - 1) if reqs else None, seed=len(reqs))
            )
            length += len(reply) + 1
        if reqs:
            per_conv.append(reqs)
    requests: list[WorkloadRequest] = []
    last_global: dict[int, int] = {}
    pending = list(range(len(per_conv)))
    pending.reverse()
    open_: list[list] = []  # [conv index, next turn]
    while pending or open_:
        while pending and len(open_) < concurrency:
            open_.append([pending.pop(), 0])
        k = rng.randrange(len(open_))
        ci, t = open_[k]
        r = per_conv[ci][t]
        if r.parent is not None:
            r.parent = last_global[ci]
        last_global[ci] = len(requests)
        requests.append(r)
        if t + 1 == len(per_conv[ci]):
            open_[k] = open_[-1]
            open_.pop()
        else:
            open_[k][1] = t + 1
    return Workload(
        "multi_turn",
        requests,
        dict(
            history="dataset",
            n_conversations=len(per_conv),
            concurrency=concurrency,
            max_turns=max_turns,
            max_context=max_context,
            reply_cap=reply_cap,
            seed=seed,
        ),
    )


def _pairs(convs, rng, q_len, a_len, n):
    """``n`` distinct (question, answer) token pairs from random conversations, truncated."""
    idx = rng.sample(range(len(convs)), n)
    return [(convs[i][0][:q_len], convs[i][1][:a_len]) for i in idx]


def few_shot(
    n: int = 2000,
    k: int = 5,
    shot_q: int = 96,
    shot_a: int = 48,
    question_len: int = 96,
    reply_len: int = 32,
    seed: int = 0,
    data=None,
) -> Workload:
    """``n`` questions sharing one k-shot chat history (see module docstring)."""
    convs, frame = data or _data()
    rng = random.Random(seed)
    pairs = _pairs(convs, rng, max(shot_q, question_len), max(shot_a, reply_len), k + n)
    shots: list[list[int]] = []
    for q, a in pairs[:k]:
        shots += [q[:shot_q], a[:shot_a]]
    reqs = [
        WorkloadRequest(_chat(frame, shots + [q[:question_len]]), a[:reply_len] + frame["eos"], seed=i)
        for i, (q, a) in enumerate(pairs[k:])
    ]
    return Workload(
        "few_shot",
        reqs,
        dict(n=n, k=k, shot_q=shot_q, shot_a=shot_a, question_len=question_len, reply_len=reply_len, seed=seed),
    )


def gsp(
    groups: int = 64,
    prompts_per_group: int = 32,
    system_len: int = 1024,
    question_len: int = 128,
    reply_len: int = 64,
    seed: int = 0,
    data=None,
) -> Workload:
    """Generated-shared-prefix workload (SGLang ``bench_serving --dataset-name
    generated-shared-prefix`` shape) from ShareGPT text, arrival shuffled across groups."""
    convs, frame = data or _data()
    rng = random.Random(seed)
    reqs = []
    for _g in range(groups):
        sys_toks: list[int] = []
        while len(sys_toks) < system_len:
            sys_toks += convs[rng.randrange(len(convs))][1]
        # "<|im_start|>system\n" + long system text + "<|im_end|>\n" (the template's own header)
        system = list(frame["system"][: len(frame["user"])]) + sys_toks[:system_len] + frame["end"]
        for q, a in _pairs(convs, rng, question_len, reply_len, prompts_per_group):
            prompt = system + frame["user"] + q + frame["end"] + frame["assistant"]
            reqs.append(WorkloadRequest(prompt, a + frame["eos"], seed=len(reqs)))
    rng.shuffle(reqs)
    return Workload(
        "gsp",
        reqs,
        dict(
            groups=groups,
            prompts_per_group=prompts_per_group,
            system_len=system_len,
            question_len=question_len,
            reply_len=reply_len,
            seed=seed,
        ),
    )


def fork(
    roots: int = 64,
    branches: int = 8,
    prompt_len: int = 512,
    branch_len: int = 64,
    followup_len: int = 48,
    reply_len: int = 32,
    seed: int = 0,
    data=None,
) -> Workload:
    """``roots`` x ``branches`` continuations, then a follow-up per branch (see module doc)."""
    convs, frame = data or _data()
    rng = random.Random(seed)
    reqs: list[WorkloadRequest] = []
    for r in range(roots):
        body: list[int] = []
        while len(body) < prompt_len:
            body += convs[rng.randrange(len(convs))][0]
        prompt = _chat(frame, [body[:prompt_len]])
        first = len(reqs)
        for b, (_, ans) in enumerate(_pairs(convs, rng, 1, branch_len, branches)):
            reqs.append(WorkloadRequest(prompt, ans + frame["eos"], seed=r * branches + b))
        for b in range(branches):  # this root's follow-ups arrive right after its branches
            q, a = _pairs(convs, rng, followup_len, reply_len, 1)[0]
            reqs.append(
                WorkloadRequest(
                    frame["end"][1:] + frame["user"] + q + frame["end"] + frame["assistant"],
                    a + frame["eos"],
                    parent=first + b,
                    seed=r * branches + b,
                )
            )
    return Workload(
        "fork",
        reqs,
        dict(
            history="generated",
            roots=roots,
            branches=branches,
            prompt_len=prompt_len,
            branch_len=branch_len,
            followup_len=followup_len,
            reply_len=reply_len,
            seed=seed,
        ),
    )


def unique(n: int = 2000, prompt_len: int = 256, reply_len: int = 32, seed: int = 0, data=None) -> Workload:
    """``n`` raw ShareGPT prompts (distinct conversations, no chat template)."""
    convs, frame = data or _data()
    rng = random.Random(seed)
    idx = [i for i in rng.sample(range(len(convs)), min(len(convs), 3 * n)) if len(convs[i][0]) >= 8][:n]
    reqs = [
        WorkloadRequest(convs[i][0][:prompt_len], convs[i][1][:reply_len] + frame["eos"], seed=j)
        for j, i in enumerate(idx)
    ]
    return Workload("unique", reqs, dict(n=len(reqs), prompt_len=prompt_len, reply_len=reply_len, seed=seed))


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "multi_turn": multi_turn,
    "few_shot": few_shot,
    "gsp": gsp,
    "fork": fork,
    "unique": unique,
}


def make_workload(name: str, **kwargs) -> Workload:
    """Build workload ``name`` (a key of :data:`WORKLOADS`); ValueError for an unknown name."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name](**kwargs)
