"""`LLM`: the offline, vLLM-shaped entry point (``generate``, ``chat``, cache stats, ``explain``)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from tqdm.auto import tqdm

from radixkv.branching import Prompt, SelectResult, Session, drive, select_program
from radixkv.cache.tenants import tenant_of
from radixkv.chat_template import render_chat
from radixkv.engine import EngineStats
from radixkv.engine.outcome import Explanation, explain_text
from radixkv.engine_args import build_engine
from radixkv.errors import RequestError
from radixkv.inputs import (
    batch_requests,
    conversations,
    params_per_prompt,
    prompt_salts,
    refuse_vllm_options,
    to_token_ids,
    to_token_prompt,
    to_token_prompts,
)
from radixkv.namespace import Namespace, with_salt
from radixkv.outputs import RequestOutput, ended_early
from radixkv.sampling_params import SamplingParams
from radixkv.text import encode_text

Message = Dict[str, Any]
FinishHook = Callable[[Any, RequestOutput], None]

logger = logging.getLogger(__name__)
_RENDERED = "messages (rendered with the chat template)"  # where a chat's text is checked: after rendering


class LLM:
    """Offline batched generation with prefix caching.

    Args:
        model: model name or path ("smollm2-135m" is SmolLM2-135M-Instruct).
        **kwargs: any :class:`~radixkv.config.EngineConfig` field: device ("auto"), dtype ("auto"),
            page_size (1), max_total_tokens (KV pool capacity in tokens), max_context_len,
            prefix_cache ("radix" | "hash" | "none"), enable_prefix_caching (False = "none"),
            attention_backend ("auto"), max_running_requests, chunked_prefill_size,
            schedule_policy ("lpm" | "fcfs"), seed, max_n, max_pinned_tokens, pin_idle_timeout,
            the KV tiers host_cache_bytes, disk_cache_dir, disk_cache_bytes, remote_cache_url,
            kv_tier_write_policy (docs/tiers.md);
            and the :class:`~radixkv.engine.Engine` keywords ``loaded_model`` (a
            :class:`~radixkv.models.loader.LoadedModel` to share weights between engines; weights
            on another device or in another dtype than the engine's are converted in a copy,
            never in place under the other engines),
            ``model_runner``, ``tokenizer``, ``eos_token_ids``, ``clock`` (the pins' time
            source), ``tier_stores`` (KV tier stores instead of those the fields name). The same
            keywords as :class:`~radixkv.async_llm.AsyncLLM`
            (:func:`radixkv.engine_args.split_engine_kwargs`).
        namespace: the prefix-cache namespace of every request of this ``LLM`` that names none
            (``generate``, ``chat``, ``generate_batch``, sessions, ``select``, ``explain``): None (the
            shared default), a :class:`~radixkv.namespace.Namespace` (e.g.
            ``Namespace(tenant="alice")``: in one process, the isolation the server gives a
            tenant) or any hashable (``Namespace.of``). A call's own ``namespace`` replaces it; a
            prompt's ``cache_salt`` (its dict, or ``SamplingParams.cache_salt``) joins it as its
            salt (:func:`radixkv.namespace.with_salt`).

    Threads: one ``LLM`` may be shared by several threads; its calls are serialized (a second
    thread's ``generate`` waits for the first's to return), since it drives its engine itself.

    Ctrl-C: while a call drives the engine on the main thread, a SIGINT is held until the step
    in progress returns (:func:`_sigint_between_steps`); the call then raises KeyboardInterrupt
    with its requests aborted, and the engine stays usable. Under a SIGINT handler of the
    program's own, the handler is left alone.

    Raises:
        ValueError: unknown keyword or invalid value (naming the field).
    """

    def __init__(self, model: str = "smollm2-135m", *, namespace: Any = None, **kwargs: Any) -> None:
        self.namespace = Namespace.of(namespace)
        self.engine = build_engine("LLM", model, kwargs)
        self._lock = threading.RLock()  # one caller drives the engine at a time
        self._stepping = False  # a _run_locked is stepping the engine (on the thread holding _lock)
        self._in_step = False  # inside Engine.step() (its event subscribers run there)
        if self.engine.kv.tiers is not None:
            _close_at_exit(self)

    def _ns(self, namespace: Any) -> Any:
        """A call's namespace: its own, else this LLM's."""
        return self.namespace if namespace is None else namespace

    @property
    def tokenizer(self):
        """The model's transformers tokenizer."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (vLLM's ``LLM.get_tokenizer()``; the same object as
        :attr:`tokenizer`)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params :meth:`generate` and :meth:`chat` use when given none, a new
        object per call (vLLM's ``LLM.get_default_sampling_params()``: read, change a field,
        pass it on).

        vLLM builds them from the model's ``generation_config.json`` (its ``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``) by default;
        radixkv reads no generation config (vLLM's ``generation_config="vllm"``), so this is
        ``SamplingParams()`` whatever the model: ``max_tokens`` 16, ``temperature`` 1.0, no
        top-p / top-k / min-p cut, no penalties (docs/engine.md).
        """
        return SamplingParams()

    def generate(
        self,
        prompts: Any = None,
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        prompt_token_ids: Union[None, Sequence[int], Sequence[Sequence[int]]] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        *,
        lora_request: Any = None,
        priority: Any = None,
    ) -> List[RequestOutput]:
        """Generate for a batch of prompts; all are submitted at once and run to completion.

        Args:
            prompts: one prompt or a list of them; a prompt is a str (tokenized with the model's
                tokenizer, no template), a list of token ids, or a dict ``{"prompt": str}`` /
                ``{"prompt_token_ids": [...]}`` (vLLM's shapes, :mod:`radixkv.inputs`), which
                may hold a ``"cache_salt"`` (the prompt's prefix-cache salt, joined to the
                LLM's namespace; with ``SamplingParams.cache_salt`` too, they must be equal).
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
            prompt_token_ids: one token-id list or a list of them, instead of ``prompts``.
            use_tqdm: show a progress bar over finished requests; or, as in vLLM, a callable
                that makes the bar (``functools.partial(tqdm, leave=False)``), called with
                ``total=`` and ``desc=`` (it needs ``update(n)`` and ``close()``).
            lora_request, priority: vLLM's; taken at their defaults (None; ``priority`` 0, or as
                vLLM gives it a list of one 0 per prompt), else a RequestError naming them
                (:func:`radixkv.inputs.refuse_vllm_options`).

        Returns:
            One finished :class:`RequestOutput` per prompt, in input order. A request whose
            sampling raised in the engine ends with finish_reason ``"error"`` and
            ``RequestOutput.error`` set; the others are not affected.

        Raises:
            RequestError: (a ValueError naming the field) neither or both of ``prompts`` /
                ``prompt_token_ids``, a prompt of another type, ``sampling_params`` not a
                ``SamplingParams`` (or a list of them of the prompts' length), or any request the
                engine refuses (e.g. prompt + ``max_tokens`` beyond ``max_context_len``, ``n``
                beyond ``max_n``); then nothing is submitted.
        """
        ids, texts = to_token_prompts(self.tokenizer, prompts, prompt_token_ids)
        refuse_vllm_options(lora_request, priority, len(ids))
        salts = prompt_salts(prompts) or [None] * len(ids)
        return self._run(ids, texts, sampling_params, use_tqdm, [with_salt(self.namespace, s) for s in salts])

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        add_generation_prompt: bool = True,
        tools: Optional[Sequence[Dict[str, Any]]] = None,
        *,
        chat_template: Optional[str] = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        lora_request: Any = None,
    ) -> List[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them,
        each rendered with the model's chat template (plus the assistant generation prompt).

        ``chat_template`` (a Jinja template instead of the model's), ``continue_final_message``
        (continue the last, assistant, message instead of starting a new one; needs
        ``add_generation_prompt=False``) and ``chat_template_kwargs`` (extra template variables)
        are vLLM's ``LLM.chat`` arguments (:func:`radixkv.chat_template.render_chat`); its
        ``lora_request`` is taken at its default (None), else a RequestError naming it.

        ``tools``: OpenAI function tools (``{"type": "function", "function": {"name",
        "description", "parameters"}}``) rendered into every conversation, by the model's
        template when it takes tools, else in radixkv's built-in ``<tool_call>`` format;
        conversations may hold assistant ``tool_calls`` and ``role: "tool"`` results
        (:mod:`radixkv.chat_template`). To force calls, pass
        :func:`radixkv.sampling.grammar.tool_call_structural_tag` (with the built-in format's
        markers, as :func:`radixkv.server.openai.params.forced_calls` does) as
        ``SamplingParams.structural_tag``, and parse the text with
        :func:`radixkv.server.parsers.tool_calls.parse_tool_calls`."""
        refuse_vllm_options(lora_request)
        convs = conversations(messages)
        options = dict(
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        texts = [self.render_chat(c, add_generation_prompt, tools, **options) for c in convs]
        ids = [encode_text(self.tokenizer, t, "messages", _RENDERED) for t in texts]
        return self._run(ids, texts, sampling_params, use_tqdm)

    def render_chat(
        self,
        conversation: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Optional[Sequence[Dict[str, Any]]] = None,
        **options: Any,
    ) -> str:
        """The chat-template text of one conversation (:func:`radixkv.chat_template.render_chat`;
        ``options``: its ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``)."""
        return render_chat(self.tokenizer, conversation, add_generation_prompt, tools, **options)

    def _run(
        self, ids: List[List[int]], texts: Optional[List[str]], sampling_params, use_tqdm: bool, namespace=None
    ) -> List[RequestOutput]:
        with self._lock:
            return self._run_locked(ids, texts, sampling_params, use_tqdm, namespace)

    def generate_batch(
        self, requests: Sequence[tuple], on_finish: Optional[Sequence[Optional[FinishHook]]] = None
    ) -> List[RequestOutput]:
        """Submit every ``(prompt token ids, SamplingParams, namespace)`` of ``requests`` together
        (they wait together, so their common prefixes are computed once) and run them to
        completion (no progress bar); the same method as :meth:`radixkv.async_llm.AsyncLLM.generate_batch`,
        which sessions and ``select`` run on.

        Args:
            requests: ``(prompt_token_ids, sampling_params, namespace)`` per request.
            on_finish: per request, None or ``fn(engine, final output)``, run in this thread
                right when that request finishes, before any further step (e.g. pin what it left
                cached), not when it was aborted or failed (``radixkv.outputs.ended_early``); an
                exception it raises is logged, not raised (as on AsyncLLM).

        Returns:
            One finished :class:`RequestOutput` per request, in order (finish_reason
            ``"error"`` and ``error`` set for a request whose sampling raised, as :meth:`generate`).

        Raises:
            RequestError: any request refused (then none is submitted); a request that is not such
                a triple (param ``requests``), ``on_finish`` not one hook or None per request
                (``on_finish``).
        """
        requests, hooks = batch_requests(requests, on_finish)
        ids = [list(r[0]) for r in requests]
        spaces = [self._ns(r[2]) for r in requests]
        with self._lock:
            return self._run_locked(ids, None, [r[1] for r in requests], False, namespace=spaces, on_finish=hooks)

    def call_in_engine_thread(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` as the engine's driver and return its result: in this thread, under
        the LLM's lock (between two other calls, never during a step); the same method as
        :meth:`radixkv.async_llm.AsyncLLM.call_in_engine_thread` (there awaited).

        Raises:
            RuntimeError: called from inside this LLM's own step (an event subscriber: the RLock
                lets the stepping thread in again), where ``fn`` would change the engine in the
                middle of its step; a finish hook runs between steps and may call it.
        """
        with self._lock, _sigint_between_steps():
            self._refuse_in_step("LLM.call_in_engine_thread (or a session's close or fork)")
            return fn(self.engine)

    def _refuse_in_step(self, what: str) -> None:
        """RuntimeError when called from inside this LLM's own step (an event subscriber; the
        caller holds the lock, which the stepping thread re-enters)."""
        if self._in_step:
            raise RuntimeError(
                f"{what} was made from inside this LLM's own step (an event subscriber); call it after the "
                "step returns, e.g. from a finish hook"
            )

    def _run_locked(
        self,
        ids: List[List[int]],
        texts: Optional[List[str]],
        sampling_params,
        use_tqdm: bool,
        namespace=None,
        on_finish: Optional[Sequence[Optional[FinishHook]]] = None,
    ) -> List[RequestOutput]:
        """Submit every prompt (in one go: they wait together, so they share their common
        prefixes), step until all finished; on any error or interrupt the submitted requests are
        aborted and released before it propagates. ``namespace``: one for all or one per prompt;
        ``on_finish``: one hook (or None) per prompt (:meth:`generate_batch`)."""
        params = params_per_prompt(sampling_params, len(ids))
        spaces = list(namespace) if isinstance(namespace, list) else [self._ns(namespace)] * len(ids)
        if self._stepping:
            # NOTE: the RLock lets the stepping thread in again: an event subscriber or a finish
            # hook calling back would step the engine inside its own step
            raise RuntimeError(
                "LLM.generate (or a session, fork or select call) was made from inside this LLM's own step "
                "(an event subscriber or a finish hook); call it after the step returns"
            )
        self._stepping = True
        try:
            with _sigint_between_steps() as interrupted:
                return self._drive(ids, texts, params, spaces, use_tqdm, on_finish, interrupted)
        finally:
            self._stepping = False

    def _drive(self, ids, texts, params, spaces, use_tqdm, on_finish, interrupted) -> List[RequestOutput]:
        """The body of :meth:`_run_locked`: submit, step until done, abort what is left on error
        (``interrupted()``, between two steps, raises a held Ctrl-C)."""
        engine = self.engine
        _check_batch(engine.config, spaces)
        rids: List[str] = []
        results: Dict[str, RequestOutput] = {}
        hooks: Dict[str, FinishHook] = {}
        bar = _progress_bar(use_tqdm, len(ids))
        try:
            for i, (p_ids, p) in enumerate(zip(ids, params)):
                rids.append(
                    engine.add_request(p_ids, p, prompt=None if texts is None else texts[i], namespace=spaces[i])
                )
                if on_finish is not None and on_finish[i] is not None:
                    hooks[rids[-1]] = on_finish[i]
            wanted = set(rids)
            while len(results) < len(rids) and engine.has_unfinished_requests():
                for out in self._step(engine):
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        _finish_hook(hooks.pop(out.request_id, None), engine, out)
                        bar.update(1)
                interrupted()
        except BaseException:
            for rid in rids:
                if rid not in results:
                    engine.abort_request(rid)
            while engine.has_unfinished_requests():
                self._step(engine)
            raise
        finally:
            bar.close()
        return [results[r] for r in rids]

    def _step(self, engine: Any) -> List[RequestOutput]:
        self._in_step = True  # the subscribers its events call run inside it
        try:
            return engine.step()
        finally:
            self._in_step = False

    def explain(
        self,
        prompt: Union[None, str, Sequence[Message]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        namespace: Any = None,
        context: int = 16,
        tools: Optional[Sequence[Dict[str, Any]]] = None,
        add_generation_prompt: bool = True,
        cache_salt: Optional[str] = None,
    ) -> Explanation:
        """What the prefix cache would give this prompt if it were sent now, and why: a dry run
        (nothing computed, nothing locked, the LRU order untouched; a read-only ``peek``).

        Args:
            prompt: a text prompt (tokenized without a template, as :meth:`generate`), token
                ids, a ``{"prompt"}`` / ``{"prompt_token_ids"}`` dict, or a conversation (a list
                of ``{"role", "content"}``, rendered as :meth:`chat`).
            prompt_token_ids: token ids instead of ``prompt``.
            namespace: the prefix-cache namespace.
            context: tokens of decoded text shown on each side of the stop position.
            tools, add_generation_prompt: a conversation's, as :meth:`chat` takes them (the
                tools are part of the rendered prompt); refused with any other prompt.
            cache_salt: the request's salt (``SamplingParams.cache_salt``, or a dict prompt's
                ``"cache_salt"``; both: equal), joined to the namespace as :meth:`generate` does.

        Returns:
            An :class:`~radixkv.engine.outcome.Explanation`: the
            :class:`~radixkv.cache.outcome.CacheOutcome` (cause, cached and missed tokens per
            cause, divergence position) and the text before the stop position, the prompt's
            text after it and the cached sequence's text there.

        Raises:
            RequestError: (a ValueError naming the field) neither or both of ``prompt`` /
                ``prompt_token_ids``, a malformed or empty prompt, token ids outside
                ``[0, vocab_size)``, a negative ``context``, a bad or conflicting ``cache_salt``,
                a prompt ``generate`` would refuse (``max_context_len`` tokens or more, or too long
                for the KV pool with one generated token; :meth:`Engine.explain`).
        """
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestError("explain: give exactly one of prompt or prompt_token_ids", "prompt")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise RequestError(f"context must be an int >= 0 (tokens), got {context!r}", "context")
        is_chat = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)
        if not is_chat and (tools or not add_generation_prompt):
            raise RequestError("explain: tools and add_generation_prompt apply to a conversation only", "tools")
        if prompt_token_ids is not None:
            ids = to_token_ids(prompt_token_ids, "prompt_token_ids")
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
            text = self.render_chat(list(conversations(prompt)[0]), add_generation_prompt, tools)
            ids = encode_text(self.tokenizer, text, "messages", _RENDERED)
        else:
            ids, _ = to_token_prompt(self.tokenizer, prompt)
        if not ids:
            raise RequestError("explain: the prompt has no tokens", "prompt")
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt_token_ids")
        dict_salt = prompt_salts(prompt)[0] if isinstance(prompt, Mapping) else None
        namespace = with_salt(with_salt(self._ns(namespace), cache_salt), dict_salt)
        with self._lock:
            outcome = self.engine.explain(ids, namespace)
        return explain_text(outcome, ids, self.tokenizer, context)

    # ------------------------------------------------------------------ branching
    def session(self, prompt: Prompt = None, *, namespace=None) -> Session:
        """A :class:`~radixkv.branching.Session`: a context that grows with each
        ``generate`` / ``chat`` call on it, its KV pinned between calls (docs/branching.md).

        Args:
            prompt: the first context: text (tokenized without a template), token ids, or chat
                messages (rendered with the chat template, without the generation prompt:
                ``session.chat(...)`` adds the next turn); None: empty.
            namespace: prefix-cache namespace of its requests.

        Raises:
            RequestError: a malformed prompt (naming ``prompt``), an unhashable ``namespace``.
        """
        return Session(self, prompt, namespace=self._ns(namespace))

    def select(self, prompt: Prompt, choices: Sequence, *, method: str = "normalized", namespace=None) -> SelectResult:
        """The log-likelihood of each choice as the continuation of ``prompt`` (SGLang's
        ``select``): every choice is one request (prompt + choice tokens, the choice tokenized
        on its own) submitted in the same step, so the prompt is computed once and the choices
        run as one batched extend over it; each scored from its prompt logprobs.

        Args:
            prompt: text (no template), token ids, or chat messages (rendered with the
                assistant's generation prompt: the choices are the reply).
            choices: non-empty list of str (or of token-id lists).
            method: "normalized" (highest mean token logprob, SGLang's default
                ``token_length_normalized``) or "sum" (highest total).
            namespace: prefix-cache namespace.

        Returns:
            A :class:`~radixkv.branching.SelectResult` (every choice's sum and mean logprob, the
            chosen index).

        Raises:
            RequestError: an empty or malformed ``prompt`` / ``choices``, a bad ``method``.
        """
        return drive(self, select_program(self, prompt, choices, method, self._ns(namespace)))

    def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Empty the prefix cache (False while requests run); ``tiers``: also the KV tiers this
        engine owns (host, disk; not a shared remote tier). RuntimeError from an event
        subscriber (inside a step)."""
        with self._lock, _sigint_between_steps():
            self._refuse_in_step("LLM.reset_prefix_cache")
            return self.engine.reset_prefix_cache(tiers=tiers)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Finish the writes queued for the KV tiers and close them (docs/tiers.md), so that a
        restart or another engine finds every block; idempotent (also done on ``with LLM(...)``
        exit and at interpreter exit, within 30 s). Returns whether every write was done within ``timeout``
        seconds (None: no limit); a call of another thread running meanwhile counts in it (False
        when it has not returned by then: nothing closed). RuntimeError from an event subscriber
        (inside a step: the tiers would close under it)."""
        start = time.monotonic()
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            self._refuse_in_step("LLM.close")
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            return self.engine.close(left)
        finally:
            self._lock.release()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def cache_stats(self) -> EngineStats:
        """See :meth:`radixkv.engine.Engine.cache_stats` (also readable as a dict); messages
        posted to the engine since its last step (e.g. a dropped session's pin release) are
        applied first. RuntimeError from an event subscriber (inside a step)."""
        with self._lock, _sigint_between_steps():
            self._refuse_in_step("LLM.cache_stats")  # it would run posted calls mid-step
            self.engine.run_posted()
            return self.engine.cache_stats()

    def num_unfinished_requests(self) -> int:
        """Requests submitted and not finished: non-zero only while a ``generate`` / ``chat`` of
        another thread runs (read without waiting for it; the same method as
        :meth:`radixkv.async_llm.AsyncLLM.num_unfinished_requests`)."""
        return self.engine.num_unfinished_requests()


_OPEN: "weakref.WeakSet[LLM]" = weakref.WeakSet()  # LLMs with KV tiers, for the exit hook to close
_EXIT_HOOK: list = []  # [True] once _close_open_at_exit is registered
_EXIT_TIMEOUT_S = 30.0  # how long the exit hook gives each LLM's close


def _close_at_exit(llm: LLM) -> None:
    """Close ``llm`` at interpreter exit if still open (:func:`_close_open_at_exit`)."""
    # NOTE: registered once, after weakref.finalize's own exit hook (the KV tiers made a
    # finalizer already), so it runs first, while the tiers are still open
    if not _EXIT_HOOK:
        atexit.register(_close_open_at_exit)
        _EXIT_HOOK.append(True)
    _OPEN.add(llm)


def _close_open_at_exit() -> None:
    """At interpreter exit, close every ``LLM`` with KV tiers still alive, as ``AsyncLLM``'s
    exit hook shuts its engines down: a write-back tier written to disk or Redis then gets the
    blocks the pool still caches, which a script that just returns used to lose (the tiers'
    own finalizers only finish the writes already queued)."""
    for llm in list(_OPEN):
        try:
            llm.close(_EXIT_TIMEOUT_S)
        except Exception:  # NOTE: one LLM's failing close must not cost the others their writes
            logging.getLogger(__name__).exception("closing an LLM at interpreter exit failed")


def _check_batch(config: Any, spaces: Sequence[Any]) -> None:
    """Refuse a batch the engine could never queue at once: more prompts than
    ``max_queued_requests``, or more of one tenant's than ``max_queued_requests_per_tenant`` (each
    prompt waits as one request; a ``QueueFullError`` mid-batch would say "retry later" of a batch
    no retry fits, as the server answers such a batch with a 400).

    Raises:
        RequestError: (a ValueError naming the limit's field) the batch is larger than it.
    """
    checks = [("max_queued_requests", config.max_queued_requests, len(spaces))]
    if config.max_queued_requests_per_tenant is not None:
        per = collections.Counter(tenant_of(Namespace.of(ns)) for ns in spaces)
        checks.append(
            ("max_queued_requests_per_tenant", config.max_queued_requests_per_tenant, max(per.values(), default=0))
        )
    for name, limit, n in checks:
        if limit is not None and n > max(limit, 1):  # NOTE: 0 refuses every request, as the engine does
            raise RequestError(f"a batch of {n} prompts is more than the engine queues at once ({name} {limit})", name)


@contextlib.contextmanager
def _sigint_between_steps() -> Iterator[Callable[[], None]]:
    """Hold a SIGINT (Ctrl-C) while the LLM changes its engine's state: a KeyboardInterrupt raised
    in the middle of a step (or a pin, a flush) leaves the radix tree and the slot allocator
    half-updated (a leaf missing from the LRU, slots neither free nor cached, a later double
    free). Yields ``interrupted()``, which raises the held KeyboardInterrupt (called between two
    steps); one still held when the block ends is raised then. Only on the main thread (the one
    signals reach) under Python's default SIGINT handler; otherwise nothing changes."""
    held: List[int] = []

    def interrupted() -> None:
        if held:
            held.clear()
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupted
        return
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupted()


def _progress_bar(use_tqdm: Any, total: int) -> Any:
    """The progress bar of a ``generate`` / ``chat`` call: tqdm's (``use_tqdm`` a bool) or the
    caller's factory's (vLLM's callable ``use_tqdm``).

    Raises:
        RequestError: (param ``use_tqdm``) anything else.
    """
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="generate")
    if not isinstance(use_tqdm, bool):
        raise RequestError(
            f"use_tqdm must be a bool or a callable making a tqdm-like bar, got {use_tqdm!r:.80}", "use_tqdm"
        )
    return tqdm(total=total, desc="generate", disable=not use_tqdm)


def _finish_hook(hook: Optional[FinishHook], engine: Any, out: RequestOutput) -> None:
    """A caller's finish hook (not on abort or error: :func:`~radixkv.outputs.ended_early`); its
    exception is logged (it must not stop the batch)."""
    if hook is None or ended_early(out):
        return
    try:
        hook(engine, out)
    except Exception:  # noqa: BLE001 - a caller's hook
        logger.exception("finish hook of %s failed", out.request_id)
