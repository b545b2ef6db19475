"""Branching programs in process: sessions, forks and select, over :class:`~radixkv.llm.LLM`
(:class:`Session`) and :class:`~radixkv.async_llm.AsyncLLM` (:class:`AsyncSession`).

In the spirit of SGLang's frontend primitives (``fork``, ``gen``, ``select``; Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs", 2024) and its sessions,
without HTTP:

* A **session** is a context of token ids that grows with each call: the prompt of a turn is the
  context so far (its previous prompt + the model's reply, token for token) + the new text, so
  each turn computes only its new tokens. Between calls the session's KV stays **pinned** in the
  engine's KV manager (one soft pin with one reference per holder,
  :meth:`~radixkv.engine.kv_manager.KVManager.pin_prefix`), bounded by
  ``EngineConfig.max_pinned_tokens`` and ``pin_idle_timeout``: past them the least recently used
  session is unpinned (its tokens become evictable, not freed; its next turn recomputes what was
  evicted). ``close()`` (or leaving a ``with`` block, also by an exception) unpins.
* ``session.fork(n)``: ``n`` child sessions holding references on the parent's pin, so they
  share its KV with no recomputation; each then runs its own prompts, seeds and constraints.
  ``forks.generate(...)`` / ``forks.chat(...)`` run the children's turns as one batch (their
  common context is computed once even when it is not cached yet: in-batch prefix sharing).
* ``select(prompt, choices)``: the log-likelihood of each choice given the prompt, every choice
  submitted in the same engine step (the prompt is computed once, by the first choice's row, and
  the others share it in that forward), scored from prompt logprobs. Reports each choice's sum and
  token-length-normalized logprob (SGLang's ``select`` with ``token_length_normalized``) and the
  chosen index.

A session made from chat messages continues the conversation with the model's chat template:
``chat(content)`` appends exactly the text the template puts between the model's reply and the
assistant's next turn (the reply's end-of-turn marker is not repeated when the model generated it).
Token ids are the tokenizer's on that text; the context is never re-tokenized.

Without a prefix cache (``prefix_cache="none"``) nothing is kept between calls: sessions and
forks work, but every turn recomputes its context and nothing is pinned.
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass
from typing import Any, Hashable, List, Mapping, Optional, Sequence, Union

from radixkv.chat_template import render_chat
from radixkv.errors import RequestError
from radixkv.outputs import RequestOutput
from radixkv.sampling_params import SamplingParams

__all__ = ["Session", "AsyncSession", "Forks", "AsyncForks", "SelectResult", "ChoiceScore"]

Message = Mapping[str, Any]
Prompt = Union[None, str, Sequence[int], Sequence[Message]]
_SENTINEL = "\x00radixkv-reply\x00"
_SELECT_METHODS = ("normalized", "sum")


@dataclass(frozen=True)
class ChoiceScore:
    """One choice of :meth:`Session.select` / ``LLM.select``.

    Attributes:
        choice: the choice as given (text or token ids).
        token_ids: its tokens, appended to the prompt's.
        token_logprobs: natural-log probability of each of its tokens given everything before it.
        logprob: their sum (the choice's log-likelihood given the prompt).
        normalized_logprob: ``logprob / len(token_ids)`` (SGLang's ``token_length_normalized``).
    """

    choice: Any
    token_ids: List[int]
    token_logprobs: List[float]
    logprob: float
    normalized_logprob: float


@dataclass(frozen=True)
class SelectResult:
    """What ``select`` returns: ``index`` of the chosen choice (the highest ``normalized_logprob``,
    or ``logprob`` with ``method="sum"``; the first on ties), ``choice`` (it, as given),
    ``scores`` (every choice's :class:`ChoiceScore`, in input order) and ``method``."""

    index: int
    choice: Any
    scores: List[ChoiceScore]
    method: str

    @property
    def logprobs(self) -> List[float]:
        """Every choice's summed logprob."""
        return [s.logprob for s in self.scores]

    @property
    def normalized_logprobs(self) -> List[float]:
        """Every choice's length-normalized logprob."""
        return [s.normalized_logprob for s in self.scores]


# ---------------------------------------------------------------------------------- validation
def _is_messages(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and (len(x) == 0 or isinstance(x[0], Mapping))


def _token_ids(x: Any, vocab_size: int, param: str) -> List[int]:
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise RequestError(f"{param} must be a sequence of token ids, got {type(x).__name__}", param)
    out = []
    for t in x:
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"{param} must hold integer token ids, got {t!r}", param)
        if not 0 <= t < vocab_size:
            raise RequestError(f"{param} holds {t}, outside the vocabulary [0, {vocab_size})", param)
        out.append(int(t))
    return out


def _messages(x: Any, param: str = "messages") -> List[dict]:
    if isinstance(x, Mapping):
        x = [x]
    if not isinstance(x, (list, tuple)):
        raise RequestError(f"{param} must be a message, a list of messages or a str, got {type(x).__name__}", param)
    out = []
    for m in x:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(f"{param}: every message needs a str 'role' and a 'content', got {m!r}", param)
        out.append(dict(m))
    return out


def _check_params(p: Any, param: str = "sampling_params") -> SamplingParams:
    if p is None:
        return SamplingParams()
    if not isinstance(p, SamplingParams):
        raise RequestError(f"{param} must be a SamplingParams, got {type(p).__name__}", param)
    if p.n != 1:
        raise RequestError(
            f"n must be 1 in a session turn (it continues one context), got {p.n}; use session.fork(n) for n branches",
            "n",
        )
    return p


def _per_child(value: Any, n: int, param: str, is_single) -> list:
    """``value`` for each of ``n`` children: one value for all, or a list of ``n``."""
    if is_single(value):
        return [value] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise RequestError(f"{param} must be one value or a list of {n} (one per fork)", param)
    return list(value)


# ---------------------------------------------------------------------------------- shared state
class _Context:
    """What :class:`Session` and :class:`AsyncSession` share: the context, the chat state, the pin,
    and how a turn's prompt is built (validated) and how the context advances after it."""

    def __init__(
        self, owner: Any, tokens: List[int], messages: Optional[List[dict]], namespace: Hashable, pin: Any, stop: Any
    ) -> None:
        self._owner = owner
        self._tokens = tokens
        self._messages = messages
        self.namespace = namespace
        self._pin = pin
        self._stop_text: Optional[str] = stop  # the end-of-turn text the model generated, if any
        self._closed = False
        self._busy = False

    # -------------------------------------------------------------- read-only views
    @property
    def tokens(self) -> List[int]:
        """The context's token ids (a copy): every turn's prompt and reply so far."""
        return list(self._tokens)

    @property
    def messages(self) -> Optional[List[dict]]:
        """The conversation (a copy) for a chat session, None for a text session (or once
        ``generate`` appended raw text to a chat)."""
        return None if self._messages is None else [dict(m) for m in self._messages]

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def pinned_tokens(self) -> int:
        """Tokens of the context its pin holds now (0 when unpinned, e.g. dropped by the bounds)."""
        return len(self._pin) if self._pin is not None and self._pin.live else 0

    def _tok(self) -> Any:
        tok = self._owner.tokenizer
        if tok is None:
            raise RequestError("text prompts and chat need the model's tokenizer", "prompt")
        return tok

    def _vocab(self) -> int:
        return int(self._owner.engine.vocab_size)

    def _check_open(self) -> None:
        if self._closed:
            raise RequestError("the session is closed", "session")
        if self._busy:
            raise RequestError("the session is running a turn already (one at a time)", "session")

    # -------------------------------------------------------------- prompts of a turn
    def _generate_prompt(self, text: Any, prompt_token_ids: Any) -> List[int]:
        if text is not None and prompt_token_ids is not None:
            raise RequestError("give text or prompt_token_ids, not both", "prompt_token_ids")
        if prompt_token_ids is not None:
            new = _token_ids(prompt_token_ids, self._vocab(), "prompt_token_ids")
        elif text is None:
            new = []
        elif isinstance(text, str):
            new = list(self._tok().encode(text, add_special_tokens=False)) if text else []
        else:
            raise RequestError(f"text must be a str or None, got {type(text).__name__}", "text")
        prompt = self._tokens + new
        if not prompt:
            raise RequestError("the session's context is empty: give text or prompt_token_ids", "text")
        return prompt

    def _chat_prompt(self, message: Any) -> tuple[List[int], List[dict]]:
        if self._messages is None:
            raise RequestError(
                "chat needs a session made from messages (and no raw generate since); use generate", "messages"
            )
        tok = self._tok()
        if message is None:
            new = []
        elif isinstance(message, str):
            new = [{"role": "user", "content": message}]
        else:
            new = _messages(message, "message")
        hist = self._messages
        old = render_chat(tok, hist, add_generation_prompt=False) if hist else ""
        full = render_chat(tok, hist + new, add_generation_prompt=True)
        if not full.startswith(old):
            raise RequestError(
                "the chat template renders earlier turns differently once a turn is added; a session "
                "cannot continue it token for token (use generate with the whole prompt)",
                "messages",
            )
        text = full[len(old) :]
        if hist and hist[-1]["role"] == "assistant" and self._stop_text is not None:
            text = self._missing_close(tok, hist) + text
        return self._tokens + list(tok.encode(text, add_special_tokens=False)), new

    def _missing_close(self, tok: Any, hist: List[dict]) -> str:
        """The text the template puts after the model's last reply that the model did not
        generate itself (its end-of-turn token, when it stopped on one, is already in the context)."""
        probe = hist[:-1] + [{"role": "assistant", "content": _SENTINEL}]
        rendered = render_chat(tok, probe, add_generation_prompt=False)
        i = rendered.rfind(_SENTINEL)
        closing = rendered[i + len(_SENTINEL) :] if i >= 0 else ""
        gen = self._stop_text
        return closing[len(gen) :] if gen and closing.startswith(gen) else closing

    def _advance(self, prompt: List[int], out: RequestOutput, new_messages: Optional[List[dict]]) -> None:
        """The turn finished: the context becomes its prompt + the reply's tokens."""
        c = out.outputs[0]
        self._tokens = list(prompt) + list(c.token_ids)
        if new_messages is None:
            self._messages = None  # raw text went in: the conversation can no longer be tracked
        elif self._messages is not None:
            self._messages = self._messages + new_messages + [{"role": "assistant", "content": c.text}]
        stop = c.stop_reason if c.finish_reason == "stop" and isinstance(c.stop_reason, int) else None
        tok = self._owner.tokenizer
        self._stop_text = "" if stop is None or tok is None else tok.decode([stop], skip_special_tokens=False)

    # -------------------------------------------------------------- select
    def _select_prompt(self, text: Any, message: Any) -> tuple[List[int], Optional[List[dict]]]:
        """The prompt the choices continue: the context + ``text`` (a text session) or + the
        chat turn ``message`` and the assistant's generation prompt (a chat session: the choices
        are the reply)."""
        if self._messages is not None:
            if text is not None:
                raise RequestError("a chat session's select takes message, not text", "text")
            return self._chat_prompt(message)
        if message is not None:
            raise RequestError("message needs a session made from chat messages; use text", "message")
        return self._generate_prompt(text, None), None

    def _append_choice(self, prompt: List[int], ids: List[int], choice: Any, new: Optional[List[dict]]) -> None:
        """``select`` chose ``ids``: they join the context (in a chat, as the assistant's reply,
        which the next turn closes with the template's end-of-turn text)."""
        self._tokens = list(prompt) + list(ids)
        if self._messages is not None:
            text = choice if isinstance(choice, str) else self._tok().decode(ids)
            self._messages = self._messages + list(new or []) + [{"role": "assistant", "content": text}]
            self._stop_text = ""

    def _choices(self, choices: Any) -> List[List[int]]:
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) == 0:
            raise RequestError("choices must be a non-empty list of str (or of token-id lists)", "choices")
        out = []
        for c in choices:
            if isinstance(c, str):
                if not c:
                    raise RequestError("choices must not hold an empty string", "choices")
                ids = list(self._tok().encode(c, add_special_tokens=False))
            else:
                ids = _token_ids(c, self._vocab(), "choices")
            if not ids:
                raise RequestError(f"choice {c!r} has no tokens", "choices")
            out.append(ids)
        return out


def _select_prompt(owner: Any, prompt: Prompt, param: str = "prompt") -> List[int]:
    """Token ids of ``select``'s prompt: text (no template), token ids, or chat messages (rendered
    with the assistant's generation prompt: the choices are the reply)."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", param)
        return list(owner.tokenizer.encode(prompt, add_special_tokens=False))
    if _is_messages(prompt):
        msgs = _messages(prompt, param)
        if not msgs:
            raise RequestError("prompt must not be an empty conversation", param)
        text = render_chat(owner.tokenizer, msgs, add_generation_prompt=True)
        return list(owner.tokenizer.encode(text, add_special_tokens=False))
    ids = _token_ids(prompt, int(owner.engine.vocab_size), param)
    if not ids:
        raise RequestError("prompt must not be empty", param)
    return ids


def select_params(prompt_len: int) -> SamplingParams:
    """What each choice of ``select`` is submitted with: one greedy token (not used) and the
    logprob of every prompt token from ``prompt_len`` on, i.e. of the choice's tokens."""
    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprob_start_len=prompt_len)


def score_choices(
    choices: Sequence[Any], prompt_len: int, ids: List[List[int]], outs: List[RequestOutput], method: str
) -> SelectResult:
    """The :class:`SelectResult` of ``select`` from each choice's output (its prompt logprobs)."""
    scores = []
    for c, toks, out in zip(choices, ids, outs):
        lps = out.prompt_logprobs
        if lps is None or out.outputs[0].finish_reason == "abort":
            raise RuntimeError(f"select: choice {c!r} was not scored (aborted)")
        row = []
        for pos, t in zip(range(prompt_len, prompt_len + len(toks)), toks):
            entry = lps[pos]
            if entry is None or t not in entry:
                raise RuntimeError(f"select: no logprob for position {pos} of choice {c!r}")
            row.append(float(entry[t].logprob))
        total = math.fsum(row)
        scores.append(ChoiceScore(c, list(toks), row, total, total / len(row)))
    key = (lambda s: s.normalized_logprob) if method == "normalized" else (lambda s: s.logprob)
    best = max(range(len(scores)), key=lambda i: (key(scores[i]), -i))
    return SelectResult(best, choices[best], scores, method)


def _check_method(method: Any) -> str:
    if method not in _SELECT_METHODS:
        raise RequestError(f"method must be one of {_SELECT_METHODS}, got {method!r}", "method")
    return method


def initial_context(owner: Any, prompt: Prompt) -> tuple[List[int], Optional[List[dict]]]:
    """A session's first context: ``(token ids, messages or None)`` from text, token ids or chat
    messages (rendered without a generation prompt: ``chat`` adds the next turn)."""
    if prompt is None:
        return [], None
    if isinstance(prompt, str):
        if owner.tokenizer is None:
            raise RequestError("text prompts need the model's tokenizer", "prompt")
        return list(owner.tokenizer.encode(prompt, add_special_tokens=False)) if prompt else [], None
    if _is_messages(prompt):
        msgs = _messages(prompt, "prompt")
        if owner.tokenizer is None:
            raise RequestError("chat messages need the model's tokenizer", "prompt")
        text = render_chat(owner.tokenizer, msgs, add_generation_prompt=False) if msgs else ""
        return list(owner.tokenizer.encode(text, add_special_tokens=False)), msgs
    return _token_ids(prompt, int(owner.engine.vocab_size), "prompt"), None


# ---------------------------------------------------------------------------------- LLM (sync)
class Session(_Context):
    """A growing, pinned context on an :class:`~radixkv.llm.LLM` (``llm.session(...)``; module
    docstring). Not thread-safe on its own; its calls take the LLM's lock like every LLM call.

    Attributes:
        namespace: the prefix-cache namespace of its requests.
    """

    def generate(
        self, text: Optional[str] = None, sampling_params: Optional[SamplingParams] = None, *, prompt_token_ids=None
    ) -> RequestOutput:
        """Continue the context with ``text`` (tokenized, no template) or ``prompt_token_ids``
        (or nothing) and generate; the reply joins the context.

        Returns:
            The turn's finished :class:`~radixkv.outputs.RequestOutput` (its prompt is the whole
            context; ``num_cached_tokens`` shows what was reused).

        Raises:
            RequestError: a closed session, bad ``text`` / ``prompt_token_ids`` /
                ``sampling_params`` (``n`` must be 1), or what the engine refuses.
        """
        return _run_turns(
            self._owner, [self], [(self._generate_prompt_checked(text, prompt_token_ids), None)], [sampling_params]
        )[0]

    def _generate_prompt_checked(self, text, prompt_token_ids):
        self._check_open()
        return self._generate_prompt(text, prompt_token_ids)

    def chat(self, message: Any = None, sampling_params: Optional[SamplingParams] = None) -> RequestOutput:
        """Add ``message`` (a user message's text, a ``{"role", "content"}`` dict or a list of
        them; None: reply to the conversation as it is) and generate the assistant's reply, which
        joins the conversation.

        Raises:
            RequestError: a session not made from messages, a malformed message, or as
                :meth:`generate`.
        """
        self._check_open()
        return _run_turns(self._owner, [self], [self._chat_prompt(message)], [sampling_params])[0]

    def fork(self, n: int) -> "Forks":
        """``n`` child sessions sharing this session's context and its pinned KV (each holds a
        reference on the pin, so the prefix stays while any of them is open).

        Raises:
            RequestError: ``n`` is not an integer >= 1, or the session is closed.
        """
        self._check_open()
        n = _check_n(n)
        llm = self._owner
        with llm._lock:
            kids = []
            for _ in range(n):
                pin = self._pin if self._pin is not None and llm.engine.retain_pin(self._pin) else None
                kids.append(Session(llm, list(self._tokens), self.messages, self.namespace, pin, self._stop_text))
        return Forks(kids)

    def select(
        self,
        choices: Sequence[Any],
        text: Optional[str] = None,
        *,
        message: Any = None,
        method: str = "normalized",
        append: bool = True,
    ) -> SelectResult:
        """Score each choice as the continuation of the context + ``text`` (a text session) or
        as the assistant's reply after the chat turn ``message`` (a chat session; None: reply to
        the conversation as it is); see ``LLM.select``. With ``append`` the chosen choice joins
        the context (as SGLang's ``select``; in a chat, as the assistant's reply).

        Raises:
            RequestError: a closed session, an empty prompt, empty or malformed ``choices``, a
                bad ``method``.
        """
        self._check_open()
        prompt, new = self._select_prompt(text, message)
        return _select(self._owner, prompt, choices, method, self.namespace, self if append else None, new)

    def close(self) -> None:
        """Unpin the context (its tokens become evictable); idempotent."""
        if self._closed:
            return
        self._closed = True
        pin, self._pin = self._pin, None
        if pin is not None:
            llm = self._owner
            with llm._lock:
                llm.engine.release_pin(pin)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({len(self._tokens)} tokens, pinned={self.pinned_tokens}, closed={self._closed})"


def _check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"n must be an integer >= 1, got {n!r}", "n")
    return n


def _run_turns(llm: Any, sessions: List[Session], prompts: List[tuple], params: List[Any]) -> List[RequestOutput]:
    """Run one turn of each session as one batch (submitted together), then advance each
    context and move its pin to the new context, under the LLM's lock (no step runs between a
    request's end and its pin)."""
    checked = [_check_params(p) for p in params]
    for s in sessions:
        s._check_open()
    if len({id(s) for s in sessions}) != len(sessions):
        raise RequestError("a session appears twice in one batch", "sessions")
    with llm._lock:
        for s in sessions:
            s._busy = True
            if s._pin is not None:
                llm.engine.kv.touch_pin(s._pin)
        try:
            outs = llm._run_locked(
                [p for p, _ in prompts], None, checked, False, namespace=[s.namespace for s in sessions]
            )
            for s, (prompt, new), out in zip(sessions, prompts, outs):
                s._advance(prompt, out, new)
                _repin(llm.engine, s)
        finally:
            for s in sessions:
                s._busy = False
    return outs


def _repin(engine: Any, s: _Context) -> None:
    """Pin the session's new context (what the finished turn left cached), then let go of the
    old pin (so the shared part never becomes evictable in between)."""
    old = s._pin
    s._pin = engine.pin_prefix(s._tokens, s.namespace)
    if old is not None:
        engine.release_pin(old)


def _select(
    llm: Any, prompt: List[int], choices: Any, method: str, namespace: Hashable, session: Any, new: Any = None
) -> SelectResult:
    """Every choice as one request (prompt + choice, scored from its prompt logprobs), all
    submitted together; with ``session``, the chosen one joins its context and its pin moves."""
    method = _check_method(method)
    ctx = session if session is not None else _Context(llm, [], None, namespace, None, None)
    ids = ctx._choices(choices)
    params = select_params(len(prompt))
    with llm._lock:
        outs = llm._run_locked([prompt + c for c in ids], None, [params] * len(ids), False, namespace=namespace)
        result = score_choices(list(choices), len(prompt), ids, outs, method)
        if session is not None:
            session._append_choice(prompt, ids[result.index], result.choice, new)
            _repin(llm.engine, session)
    return result


class Forks(list):
    """The children of :meth:`Session.fork` (a list of :class:`Session`), with batch calls: every
    child's turn in one engine batch, so their shared context is computed at most once."""

    def generate(
        self, text: Any = None, sampling_params: Any = None, *, prompt_token_ids: Any = None
    ) -> List[RequestOutput]:
        """Each child's :meth:`Session.generate` in one batch: ``text`` / ``prompt_token_ids`` /
        ``sampling_params`` one for all or one per child (a list of ``len(self)``).

        Raises:
            RequestError: as :meth:`Session.generate`, or a list of the wrong length.
        """
        n = len(self)
        texts = _per_child(text, n, "text", lambda v: v is None or isinstance(v, str))
        ids = _per_child(
            prompt_token_ids, n, "prompt_token_ids", lambda v: v is None or (bool(v) and isinstance(v[0], int))
        )
        params = _per_child(sampling_params, n, "sampling_params", lambda v: v is None or isinstance(v, SamplingParams))
        prompts = [(s._generate_prompt_checked(t, i), None) for s, t, i in zip(self, texts, ids)]
        return _run_turns(self[0]._owner, list(self), prompts, params) if n else []

    def chat(self, message: Any = None, sampling_params: Any = None) -> List[RequestOutput]:
        """Each child's :meth:`Session.chat` in one batch (``message`` / ``sampling_params`` one
        for all or a list of one per child)."""
        n = len(self)
        msgs = _per_child(message, n, "message", lambda v: v is None or isinstance(v, (str, Mapping)))
        params = _per_child(sampling_params, n, "sampling_params", lambda v: v is None or isinstance(v, SamplingParams))
        for s in self:
            s._check_open()
        prompts = [s._chat_prompt(m) for s, m in zip(self, msgs)]
        return _run_turns(self[0]._owner, list(self), prompts, params) if n else []

    def close(self) -> None:
        """Close every child."""
        for s in self:
            s.close()

    def __enter__(self) -> "Forks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------- AsyncLLM
class AsyncSession(_Context):
    """:class:`Session`'s counterpart on an :class:`~radixkv.async_llm.AsyncLLM`
    (``llm.session(...)``): the same calls, awaited; pins move on the engine thread right when a
    turn's request finishes. One turn at a time per session."""

    async def generate(
        self, text: Optional[str] = None, sampling_params: Optional[SamplingParams] = None, *, prompt_token_ids=None
    ) -> RequestOutput:
        """As :meth:`Session.generate`."""
        self._check_open()
        prompt = self._generate_prompt(text, prompt_token_ids)
        return (await _arun_turns(self._owner, [self], [(prompt, None)], [sampling_params]))[0]

    async def chat(self, message: Any = None, sampling_params: Optional[SamplingParams] = None) -> RequestOutput:
        """As :meth:`Session.chat`."""
        self._check_open()
        return (await _arun_turns(self._owner, [self], [self._chat_prompt(message)], [sampling_params]))[0]

    async def fork(self, n: int) -> "AsyncForks":
        """As :meth:`Session.fork`."""
        self._check_open()
        n = _check_n(n)
        pin = self._pin
        owner = self._owner

        def undo(held: List[bool]) -> None:  # cancelled after the references were taken: give them back
            if owner.is_running:
                owner._submit(lambda e: [e.release_pin(pin) for ok in held if ok])

        held = await _in_engine_thread(owner, lambda e: [pin is not None and e.retain_pin(pin) for _ in range(n)], undo)
        return AsyncForks(
            AsyncSession(
                self._owner, list(self._tokens), self.messages, self.namespace, pin if ok else None, self._stop_text
            )
            for ok in held
        )

    async def select(
        self,
        choices: Sequence[Any],
        text: Optional[str] = None,
        *,
        message: Any = None,
        method: str = "normalized",
        append: bool = True,
    ) -> SelectResult:
        """As :meth:`Session.select`."""
        self._check_open()
        prompt, new = self._select_prompt(text, message)
        return await _aselect(self._owner, prompt, choices, method, self.namespace, self if append else None, new)

    async def close(self) -> None:
        """Unpin the context; idempotent (a no-op once the AsyncLLM is shut down: its engine
        holds nothing any more)."""
        if self._closed:
            return
        self._closed = True
        pin, self._pin = self._pin, None
        if pin is not None and self._owner.is_running:  # shielded: a cancelled close still unpins
            await asyncio.shield(asyncio.wrap_future(self._owner._submit(lambda e: e.release_pin(pin))))

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession({len(self._tokens)} tokens, pinned={self.pinned_tokens}, closed={self._closed})"


async def _arun_turns(
    llm: Any, sessions: List[AsyncSession], prompts: List[tuple], params: List[Any]
) -> List[RequestOutput]:
    checked = [_check_params(p) for p in params]
    for s in sessions:
        s._check_open()
    if len({id(s) for s in sessions}) != len(sessions):
        raise RequestError("a session appears twice in one batch", "sessions")
    pins: dict = {}
    done: dict = {}
    lock = threading.Lock()  # a hook runs either before the caller settles the batch, or not at all
    settled = [False]

    def hook_for(i: int, s: AsyncSession, prompt: List[int]):
        def hook(engine: Any, out: RequestOutput) -> None:  # the engine thread, at the turn's end
            with lock:
                if settled[0]:  # the caller gave up (cancelled) first: the session stays as it was
                    return
                tokens = list(prompt) + list(out.outputs[0].token_ids)
                pins[i] = engine.pin_prefix(tokens, s.namespace)
                if s._pin is not None:
                    engine.release_pin(s._pin)
                done[i] = out

        return hook

    for s in sessions:
        s._busy = True
    try:
        specs = [(p, sp, s.namespace) for (p, _), sp, s in zip(prompts, checked, sessions)]
        hooks = [hook_for(i, s, p) for i, (s, (p, _)) in enumerate(zip(sessions, prompts))]
        return await llm._generate_batch(specs, hooks)
    finally:
        # every turn that finished (also when another of the batch failed) advances its session
        # and holds its new pin; the others keep their context and old pin
        with lock:
            settled[0] = True
        for i, (s, (prompt, new)) in enumerate(zip(sessions, prompts)):
            if i in done:
                s._advance(prompt, done[i], new)
                s._pin = pins.get(i)
            s._busy = False


async def _aselect(
    llm: Any, prompt: List[int], choices: Any, method: str, namespace: Hashable, session: Any, new: Any = None
) -> SelectResult:
    method = _check_method(method)
    ctx = session if session is not None else _Context(llm, [], None, namespace, None, None)
    ids = ctx._choices(choices)
    params = select_params(len(prompt))
    if session is not None:
        session._busy = True
    try:
        outs = await llm._generate_batch([(prompt + c, params, namespace) for c in ids])
        result = score_choices(list(choices), len(prompt), ids, outs, method)
        if session is not None:
            old = session._pin
            session._append_choice(prompt, ids[result.index], result.choice, new)
            tokens = list(session._tokens)

            def keep(pin: Any) -> None:  # cancelled meanwhile: the session still gets its new pin
                session._pin = pin

            session._pin = await _in_engine_thread(llm, lambda e: _swap_pin(e, tokens, namespace, old), keep)
    finally:
        if session is not None:
            session._busy = False
    return result


async def _in_engine_thread(llm: Any, fn: Any, on_abandoned: Any) -> Any:
    """``fn(engine)`` on the engine thread; if the caller is cancelled while it runs, it still
    completes and ``on_abandoned(result)`` gets what it returned (so no pin reference is lost)."""
    task = asyncio.ensure_future(llm.call_in_engine_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else on_abandoned(t.result()))
        raise


def _swap_pin(engine: Any, tokens: List[int], namespace: Hashable, old: Any) -> Any:
    pin = engine.pin_prefix(tokens, namespace)
    if old is not None:
        engine.release_pin(old)
    return pin


class AsyncForks(list):
    """The children of :meth:`AsyncSession.fork`, with batch calls (as :class:`Forks`)."""

    async def generate(
        self, text: Any = None, sampling_params: Any = None, *, prompt_token_ids: Any = None
    ) -> List[RequestOutput]:
        """As :meth:`Forks.generate`."""
        n = len(self)
        texts = _per_child(text, n, "text", lambda v: v is None or isinstance(v, str))
        ids = _per_child(
            prompt_token_ids, n, "prompt_token_ids", lambda v: v is None or (bool(v) and isinstance(v[0], int))
        )
        params = _per_child(sampling_params, n, "sampling_params", lambda v: v is None or isinstance(v, SamplingParams))
        for s in self:
            s._check_open()
        prompts = [(s._generate_prompt(t, i), None) for s, t, i in zip(self, texts, ids)]
        return await _arun_turns(self[0]._owner, list(self), prompts, params) if n else []

    async def chat(self, message: Any = None, sampling_params: Any = None) -> List[RequestOutput]:
        """As :meth:`Forks.chat`."""
        n = len(self)
        msgs = _per_child(message, n, "message", lambda v: v is None or isinstance(v, (str, Mapping)))
        params = _per_child(sampling_params, n, "sampling_params", lambda v: v is None or isinstance(v, SamplingParams))
        for s in self:
            s._check_open()
        prompts = [s._chat_prompt(m) for s, m in zip(self, msgs)]
        return await _arun_turns(self[0]._owner, list(self), prompts, params) if n else []

    async def close(self) -> None:
        """Close every child."""
        for s in self:
            await s.close()

    async def __aenter__(self) -> "AsyncForks":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
