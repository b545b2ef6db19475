"""The branching core, written once for :class:`~radixkv.llm.LLM` and
:class:`~radixkv.async_llm.AsyncLLM`: a session's state (its context, conversation and pin), how
each call's prompt is built, and each call as a *program* (a generator of
:class:`~radixkv.branching.driver.Submit` / :class:`~radixkv.branching.driver.EngineCall`
effects) that a thin driver runs: :func:`~radixkv.branching.driver.drive` for ``LLM``,
:func:`~radixkv.branching.driver.drive_async` for ``AsyncLLM``.

Every public method of :class:`Context` and :class:`ForkList` is ``self._run(program)``: a
:class:`~radixkv.branching.Session` runs it synchronously, an
:class:`~radixkv.branching.AsyncSession` returns an awaitable of the same result.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable, List, Mapping, Optional, Sequence

from radixkv.branching.chat import continue_chat, reply_stop_text, reply_tokens
from radixkv.branching.driver import EngineCall, Program, Submit
from radixkv.branching.prompts import (
    Prompt,
    choice_ids,
    fork_count,
    initial_context,
    messages,
    per_child,
    render_messages,
    select_prompt,
    token_ids,
    turn_params,
)
from radixkv.branching.scoring import SelectResult, check_method, score_choices, select_params
from radixkv.errors import RequestError
from radixkv.namespace import Namespace, with_salt
from radixkv.outputs import RequestOutput
from radixkv.sampling_params import SamplingParams
from radixkv.text import encode_text

__all__ = ["Context", "ForkList", "turns_program", "select_program"]


class Context:
    """A growing, pinned context on an ``LLM`` or ``AsyncLLM`` (``owner``), made by
    ``owner.session(prompt, namespace=...)``: the base of :class:`~radixkv.branching.Session` and
    :class:`~radixkv.branching.AsyncSession`, which only choose the driver (``_run``). One turn
    (or appending ``select``) at a time per session: another one, from any task or thread, while
    one runs is a RequestError naming ``session`` (a call claims its sessions atomically before
    it reads their context); ``close`` may come from any thread at any time.

    Args:
        owner: the ``LLM`` / ``AsyncLLM`` whose engine runs the turns.
        prompt: the first context (:func:`~radixkv.branching.prompts.initial_context`).
        namespace: the prefix-cache namespace of its requests.

    Raises:
        RequestError: a malformed prompt (param ``prompt``), an unhashable ``namespace``
            (param ``namespace``).
    """

    _forks: type  # the ForkList subclass fork() returns

    def __init__(self, owner: Any, prompt: Prompt = None, *, namespace: Hashable = None) -> None:
        Namespace.of(namespace)  # refused now, not at the first turn
        tokens, msgs = initial_context(owner, prompt)
        self._set(owner, tokens, msgs, namespace, None, None)

    def _set(self, owner: Any, tokens: List[int], msgs: Optional[List[dict]], namespace: Hashable, pin, stop) -> None:
        self._owner = owner
        self._tokens = tokens
        self._messages = msgs
        self.namespace = namespace
        self._pin = pin
        self._stop_text: Optional[str] = stop  # the end-of-turn text the model generated, if any
        self._closed = False
        self._busy = False

    def _run(self, program: Program) -> Any:
        raise NotImplementedError

    def __del__(self) -> None:
        # NOTE: a session dropped while open gives its pin reference back (as an abandoned
        # AsyncLLM stream aborts), else its context would stay pinned until pin_idle_timeout.
        # The release is posted: a finalizer may run on any thread, and Engine.post is re-entrant.
        pin = getattr(self, "_pin", None)
        if pin is None or getattr(self, "_closed", True):
            return
        try:
            self._owner.engine.post(lambda e: e.release_pin(pin))
        except Exception:  # noqa: BLE001 - at interpreter exit the engine may be gone already
            pass

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._tokens)} tokens, pinned={self.pinned_tokens}, closed={self._closed})"

    # -------------------------------------------------------------- the calls (one body each)
    def generate(
        self, text: Optional[str] = None, sampling_params: Optional[SamplingParams] = None, *, prompt_token_ids=None
    ) -> Any:
        """Continue the context with ``text`` (tokenized, no template) or ``prompt_token_ids``
        (or nothing) and generate; the reply joins the context.

        Returns:
            The turn's finished :class:`~radixkv.outputs.RequestOutput` (its prompt is the whole
            context; ``num_cached_tokens`` shows what was reused); awaitable on an AsyncSession.

        Raises:
            RequestError: a closed or busy session (param ``session``), bad ``text`` /
                ``prompt_token_ids`` / ``sampling_params`` (``n`` must be 1), or what the engine
                refuses.
        """
        return self._run(
            self._turn_program(lambda: (self._generate_prompt(text, prompt_token_ids), None), sampling_params)
        )

    def chat(self, message: Any = None, sampling_params: Optional[SamplingParams] = None) -> Any:
        """Add ``message`` (a user message's text, a ``{"role", "content"}`` dict or a list of
        them; None: reply to the conversation as it is) and generate the assistant's reply, which
        joins the conversation. Returns as :meth:`generate`.

        Raises:
            RequestError: a session not made from messages, a malformed message, or as
                :meth:`generate`.
        """
        return self._run(self._turn_program(lambda: self._chat_prompt(message), sampling_params))

    def fork(self, n: int) -> Any:
        """``n`` child sessions sharing this session's context and its pinned KV (each holds a
        reference on the pin, so the prefix stays while any of them is open), as a
        :class:`~radixkv.branching.Forks` (``AsyncForks``, awaitable, on an AsyncSession).

        Raises:
            RequestError: (param ``n``) ``n`` not an integer in ``[1, EngineConfig.max_n]`` (the
                bound of ``SamplingParams.n``, 128 by default); a closed session (``session``).
        """
        return self._run(self._fork_program(n))

    def select(
        self,
        choices: Sequence[Any],
        text: Optional[str] = None,
        *,
        message: Any = None,
        method: str = "normalized",
        append: bool = True,
    ) -> Any:
        """Score each choice as the continuation of the context + ``text`` (a text session) or
        as the assistant's reply after the chat turn ``message`` (a chat session; None: reply to
        the conversation as it is); see ``LLM.select``. With ``append`` the chosen choice joins
        the context (as SGLang's ``select``; in a chat, as the assistant's reply) and the pin
        moves to it. Returns a :class:`~radixkv.branching.SelectResult` (awaitable on an
        AsyncSession).

        Raises:
            RequestError: a closed session, an empty prompt, empty or malformed ``choices``, a
                bad ``method``.
        """
        return self._run(self._select_program(choices, text, message, method, append))

    def close(self) -> Any:
        """Unpin the context (its tokens become evictable); idempotent (awaitable on an
        AsyncSession, a no-op once its AsyncLLM is shut down: the engine holds nothing then)."""
        return self._run(self._close_program())

    # -------------------------------------------------------------- programs
    def _turn_program(self, make_prompt: Any, sampling_params: Any) -> Program:
        self._check_open()
        outs = yield from turns_program([self], [make_prompt], [sampling_params])
        return outs[0]

    def _fork_program(self, n: Any) -> Program:
        self._check_open()
        n = fork_count(n, int(self._owner.engine.config.max_n))
        pin = self._pin
        held = [False] * n
        if pin is not None:
            held = yield EngineCall(
                lambda e: [e.retain_pin(pin) for _ in range(n)],
                undo=lambda e, got: [e.release_pin(pin) for ok in got if ok],  # the caller left: give them back
            )
        return self._forks(self._child(pin if ok else None) for ok in held)

    def _child(self, pin: Any) -> "Context":
        child = object.__new__(type(self))
        child._set(self._owner, list(self._tokens), self.messages, self.namespace, pin, self._stop_text)
        return child

    def _select_program(self, choices: Any, text: Any, message: Any, method: str, append: bool) -> Program:
        self._check_open()
        if not isinstance(append, bool):
            raise RequestError(f"append must be a bool, got {append!r}", "append")
        if not append:  # reads the context only
            prompt, new = self._select_prompt(text, message)
            return (yield from _scored(self._owner, prompt, choices, method, self.namespace, None, new))
        _claim([self])  # before the context is read: it is this call's until it returns
        try:
            prompt, new = self._select_prompt(text, message)
            return (yield from _scored(self._owner, prompt, choices, method, self.namespace, self, new))
        finally:
            self._busy = False

    def _close_program(self) -> Program:
        if self._closed:
            return
        self._closed = True
        if self._pin is None and not self._busy:
            return  # nothing pinned, and no turn in flight that could pin
        yield EngineCall(self._unpin, release=True)

    def _unpin(self, engine: Any) -> None:
        """Let go of the pin the session holds (on the engine's driver thread, where a running
        turn's finish hook and ``select``'s re-pin swap it, so a close while they run releases
        the pin they leave, and they pin nothing for a closed session)."""
        pin, self._pin = self._pin, None
        if pin is not None:
            engine.release_pin(pin)

    # -------------------------------------------------------------- prompts of a turn
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
            raise RequestError(
                "the session is running a turn already (one at a time: another call, task or thread uses it)", "session"
            )

    def _generate_prompt(self, text: Any, prompt_token_ids: Any) -> List[int]:
        if text is not None and prompt_token_ids is not None:
            raise RequestError("give text or prompt_token_ids, not both", "prompt_token_ids")
        if prompt_token_ids is not None:
            new = token_ids(prompt_token_ids, self._vocab(), "prompt_token_ids")
        elif text is None:
            new = []
        elif isinstance(text, str):
            new = encode_text(self._tok(), text, "text") if text else []
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
            new = messages(message, "message")
            render_messages(tok, new, False, "message")  # what the template refuses in them, named so
        return continue_chat(tok, self._tokens, self._messages, new, self._stop_text), new

    def _advance(
        self, prompt: List[int], out: RequestOutput, new_messages: Optional[List[dict]], params: SamplingParams
    ) -> None:
        """The turn finished: the context becomes its prompt + the reply's tokens (in a chat, the
        reply joins the conversation as its text; decoded here when the turn's ``detokenize`` was
        False, which leaves it no text)."""
        c = out.outputs[0]
        reply = reply_tokens(self._owner.tokenizer, c)
        self._tokens = list(prompt) + reply
        if new_messages is None:
            self._messages = None  # raw text went in: the conversation can no longer be tracked
        elif self._messages is not None:
            skip = params.skip_special_tokens
            text = c.text if params.detokenize else self._tok().decode(reply, skip_special_tokens=skip)
            self._messages = self._messages + new_messages + [{"role": "assistant", "content": text}]
        self._stop_text = reply_stop_text(self._owner.tokenizer, c, params)

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

    def _repin(self) -> Any:
        """The engine call that pins the current context and then lets go of the old pin (so
        the shared part never becomes evictable in between); it sets ``_pin`` itself on the
        engine thread, so a caller cancelled meanwhile still leaves the session holding it. A
        session closed meanwhile pins nothing (its close releases the pin it holds)."""
        tokens = list(self._tokens)

        def repin(engine: Any) -> None:
            if self._closed:
                return
            old, self._pin = self._pin, engine.pin_prefix(tokens, self.namespace)
            if old is not None:
                engine.release_pin(old)

        return repin


class _Batch:
    """One batch of turns: each turn's finish hook (run on the engine's driver thread, before any
    further step) pins the turn's new context and swaps it for the session's old pin (there, so a
    ``close`` racing the turn releases whichever pin the session holds; a session closed before
    its turn finished pins nothing new); ``settle`` (the caller, after the batch, also when it
    failed or was cancelled) advances every session whose turn finished. A hook runs either
    before ``settle`` or not at all, so a turn abandoned mid-way leaves its session as it was."""

    def __init__(self, sessions: List[Context], prompts: List[tuple], spaces: List[Any], params: List[Any]) -> None:
        self.sessions, self.prompts, self.spaces, self.params = sessions, prompts, spaces, params
        self.done: dict = {}
        self.lock = threading.Lock()
        self.settled = False

    def hook(self, i: int) -> Any:
        s, prompt, space = self.sessions[i], self.prompts[i][0], self.spaces[i]

        def on_finish(engine: Any, out: RequestOutput) -> None:
            with self.lock:
                if self.settled:  # the caller gave up first: the session stays as it was
                    return
                self.done[i] = out
                if s._closed:  # its close lets go of the pin it holds
                    return
                reply = reply_tokens(s._owner.tokenizer, out.outputs[0])
                old, s._pin = s._pin, engine.pin_prefix(list(prompt) + reply, space)
                if old is not None:
                    engine.release_pin(old)

        return on_finish

    def settle(self) -> None:
        with self.lock:
            self.settled = True
        for i, (s, (prompt, new)) in enumerate(zip(self.sessions, self.prompts)):
            if i in self.done:
                s._advance(prompt, self.done[i], new, self.params[i])


def _claim(sessions: List[Context]) -> None:
    """Mark every session busy, at once for all (another thread may be claiming them too): each
    open and idle, or none marked and a RequestError naming ``session``. A call claims its
    sessions before it reads their context, so a turn never runs on a context another call is
    advancing."""
    with _CLAIM_LOCK:
        for s in sessions:
            s._check_open()
        for s in sessions:
            s._busy = True


_CLAIM_LOCK = threading.Lock()


def turns_program(sessions: List[Context], make_prompts: List[Any], params: List[Any]) -> Program:
    """One turn of each session (``make_prompts[i]()``: ``(prompt token ids, new chat messages
    or None)``, built once the sessions are claimed) submitted as one batch, so their common context is computed at most once; returns
    the outputs in order. A turn runs (and its context is pinned) in its session's namespace with
    its ``cache_salt`` joined, as ``Engine.add_request`` does. Every turn that finished advances its session and moves its pin (also
    when another of the batch failed); the others keep their context and pin.

    Raises:
        RequestError: bad ``sampling_params``, a closed or busy session, a session twice, a
            ``cache_salt`` other than the session namespace's own salt.
    """
    checked = [turn_params(p) for p in params]
    for s in sessions:
        s._check_open()
    if len({id(s) for s in sessions}) != len(sessions):
        raise RequestError("a session appears twice in one batch", "sessions")
    _claim(sessions)
    batch = None
    try:
        prompts = [make() for make in make_prompts]
        # a turn's cache_salt joins its namespace (as Engine.add_request does): its context is pinned there
        spaces = [
            s.namespace if sp.cache_salt is None else with_salt(s.namespace, sp.cache_salt)
            for s, sp in zip(sessions, checked)
        ]
        batch = _Batch(sessions, prompts, spaces, checked)
        pins = [s._pin for s in sessions if s._pin is not None]
        if pins:  # the sessions in use become the most recently used pins
            yield EngineCall(lambda e: [e.touch_pin(p) for p in pins])
        requests = [(p, sp, ns) for (p, _), sp, ns in zip(prompts, checked, spaces)]
        return (yield Submit(requests, [batch.hook(i) for i in range(len(sessions))]))
    finally:
        if batch is not None:
            batch.settle()
        for s in sessions:
            s._busy = False


def _scored(
    owner: Any, prompt: List[int], choices: Any, method: str, namespace: Hashable, session: Any, new: Any
) -> Program:
    """Every choice as one request (prompt + choice, scored from its prompt logprobs), all
    submitted together; with ``session``, the chosen one joins its context and its pin moves."""
    method = check_method(method)
    ids = choice_ids(owner.tokenizer, int(owner.engine.vocab_size), choices)
    limit = int(owner.engine.max_context_len)
    for i, c in enumerate(ids):  # (a prompt too long for any choice is the engine's to refuse: "prompt")
        if len(prompt) + 1 < limit <= len(prompt) + len(c):
            raise RequestError(
                f"choice {i} makes a prompt of {len(prompt) + len(c)} tokens (the prompt's {len(prompt)} and its "
                f"{len(c)}); max_context_len is {limit} (the prompt plus at least one generated token must fit)",
                "choices",
            )
    params = select_params(len(prompt))
    try:
        outs = yield Submit([(prompt + c, params, namespace) for c in ids])
    except RequestError as exc:
        if exc.param != "max_tokens":
            raise
        # select's own max_tokens is 1: what does not fit the KV pool is the prompt + a choice
        raise RequestError(f"the prompt + a choice does not fit the KV pool: {exc}", "choices") from exc
    result = score_choices(list(choices), len(prompt), ids, outs, method)
    if session is not None:  # claimed by the caller
        session._append_choice(prompt, ids[result.index], result.choice, new)
        yield EngineCall(session._repin())
    return result


def select_program(
    owner: Any, prompt: Prompt, choices: Sequence[Any], method: str = "normalized", namespace: Hashable = None
) -> Program:
    """The program of ``LLM.select`` / ``AsyncLLM.select`` (run it with ``drive`` /
    ``drive_async``): ``prompt`` (text, token ids or chat messages) and every choice scored;
    returns a :class:`~radixkv.branching.SelectResult`.

    Raises:
        RequestError: an empty or malformed ``prompt`` / ``choices``, a bad ``method``.
    """
    ids = select_prompt(owner, prompt)
    result: SelectResult = yield from _scored(owner, ids, choices, method, namespace, None, None)
    return result


def _one_text(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _one_ids(v: Any) -> bool:
    # an empty sequence is one value (no new tokens, as Session.generate takes it): no list of n is empty
    return v is None or (
        isinstance(v, Sequence) and not isinstance(v, (str, bytes)) and (len(v) == 0 or isinstance(v[0], int))
    )


def _one_params(v: Any) -> bool:
    return v is None or isinstance(v, SamplingParams)


def _one_message(v: Any) -> bool:
    """One turn for every child: a text, a message dict, or a list of message dicts (one turn of
    several messages, as ``LLM.chat`` reads a list of dicts as one conversation)."""
    if isinstance(v, (list, tuple)):
        return bool(v) and all(isinstance(m, Mapping) for m in v)
    return v is None or isinstance(v, (str, Mapping))


class ForkList(list):
    """The children of ``fork(n)`` (a list of sessions) with batch calls, written once: every
    child's turn in one engine batch, so their shared context is computed at most once. The base
    of :class:`~radixkv.branching.Forks` and :class:`~radixkv.branching.AsyncForks`."""

    def _run(self, program: Program) -> Any:
        raise NotImplementedError

    def _owner_of(self) -> Any:
        """The children's ``LLM`` / ``AsyncLLM`` (None for no children: nothing to run)."""
        return self[0]._owner if self else None

    def generate(self, text: Any = None, sampling_params: Any = None, *, prompt_token_ids: Any = None) -> Any:
        """Each child's ``generate`` in one batch: ``text`` / ``prompt_token_ids`` /
        ``sampling_params`` one for all or one per child (a list of ``len(self)``). Returns the
        outputs in order (awaitable on AsyncForks).

        Raises:
            RequestError: as ``Session.generate``, or a list of the wrong length.
        """
        return self._run(self._generate_program(text, sampling_params, prompt_token_ids))

    def chat(self, message: Any = None, sampling_params: Any = None) -> Any:
        """Each child's ``chat`` in one batch (``message`` / ``sampling_params`` one for all or
        a list of one per child). One message for all is a text, a dict or a list of dicts (one
        turn of several messages, as ``LLM.chat`` reads it); one per child is a list of texts,
        dicts, lists of dicts or None, with at least one item not a dict."""
        return self._run(self._chat_program(message, sampling_params))

    def close(self) -> Any:
        """Close every child (awaitable on AsyncForks)."""
        return self._run(self._close_program())

    def _generate_program(self, text: Any, sampling_params: Any, prompt_token_ids: Any) -> Program:
        n = len(self)
        texts = per_child(text, n, "text", _one_text)
        ids = per_child(prompt_token_ids, n, "prompt_token_ids", _one_ids)
        params = per_child(sampling_params, n, "sampling_params", _one_params)
        for s in self:
            s._check_open()
        prompts = [lambda s=s, t=t, i=i: (s._generate_prompt(t, i), None) for s, t, i in zip(self, texts, ids)]
        return (yield from turns_program(list(self), prompts, params)) if n else []

    def _chat_program(self, message: Any, sampling_params: Any) -> Program:
        n = len(self)
        msgs = per_child(message, n, "message", _one_message)
        params = per_child(sampling_params, n, "sampling_params", _one_params)
        for s in self:
            s._check_open()
        prompts = [lambda s=s, m=m: s._chat_prompt(m) for s, m in zip(self, msgs)]
        return (yield from turns_program(list(self), prompts, params)) if n else []

    def _close_program(self) -> Program:
        for s in self:
            yield from s._close_program()
