"""Structured outputs: grammar-constrained decoding with xgrammar (Dong et al., "XGrammar:
Flexible and Efficient Structured Generation Engine for Large Language Models", 2024), the grammar
engine vLLM and SGLang use.

Life of a constraint (docs/sampling.md):

1. ``SamplingParams`` checks the field's type and gives its canonical text
   (:attr:`~radixkv.sampling_params.SamplingParams.structured_output`).
2. :meth:`GrammarBackend.validate` (called by ``Engine.add_request``, on the caller's thread)
   parses it into an ``xgrammar.Grammar``; a bad schema / regex / grammar raises
   :class:`~radixkv.errors.RequestError` naming the field with xgrammar's message, so nothing
   enters the engine. Parsed grammars are kept by canonical text.
3. :meth:`GrammarBackend.compile` compiles it for the model's vocabulary on a background thread
   and returns a ``Future``; compiled grammars are cached by the request's prefix-cache namespace
   and canonical text (compiled once per namespace, also when requests with the same constraint
   arrive while it compiles): as the prefix cache, the cache never serves one tenant (or salt)
   what another's request compiled, so a compile skipped never tells that someone else sent the
   same schema (docs/security.md). The engine holds the
   request back from the scheduler until its future is done, so a grammar that is still
   compiling delays nothing else.
4. Each sample gets its own :class:`GrammarState` (an ``xgrammar.GrammarMatcher``): every step
   the sampling pipeline fills the token bitmask of the constrained rows only, applies it to
   the logits (:func:`apply_token_bitmask`) before any other processor, and advances the
   matcher on the sampled token. EOS is allowed only where the grammar may end; the sample
   finishes (``"stop"``) when the matcher has accepted it (:attr:`GrammarState.terminated`).

The tokenizer info comes from the model's transformers tokenizer
(``xgrammar.TokenizerInfo.from_huggingface``) with ``vocab_size`` the model's logits width and the
engine's EOS ids as stop tokens; it is built on the compile thread at the first constrained
request.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from radixkv.errors import RequestError
from radixkv.kernels import cpu as cpu_kernels
from radixkv.namespace import namespace_key
from radixkv.sampling.schema_check import regex_lookaround, structural_tag_schemas, unenforced_keyword

__all__ = [
    "GrammarBackend",
    "GrammarState",
    "accept_tokens",
    "any_json_ebnf",
    "apply_token_bitmask",
    "batch_matcher",
    "choice_ebnf",
    "fill_bitmasks",
    "tool_call_structural_tag",
    "tool_calls_or",
]

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+?:\d+: ")  # "[16:53:01] /project/cpp/x.cc:5082: "


def _key(structured: Tuple[str, str], namespace: Any) -> Tuple[bytes, str, str]:
    """The cache key of a constraint in a namespace (:class:`GrammarBackend`'s caches)."""
    return (namespace_key(namespace), structured[0], structured[1])


def _xgr():
    import xgrammar  # lazy: only requests with a constraint pay its import

    return xgrammar


@functools.cache
def any_json_ebnf() -> str:
    """The EBNF of any JSON object or array (xgrammar's ``Grammar.builtin_json_grammar``, as
    text): SGLang's ``json_schema: "$$ANY$$"``."""
    return str(_xgr().Grammar.builtin_json_grammar())


def _message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source-location prefix, on one line."""
    text = " ".join(str(exc).split())
    return _XGR_PREFIX.sub("", text) or type(exc).__name__


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar (xgrammar's dialect) matching exactly one of ``choices``: ``root ::= "a" |
    "b"``, each literal escaped (quote, backslash, control characters as ``\\uXXXX``)."""

    def lit(s: str) -> str:
        out = []
        for ch in s:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


def _check_schemas(kind: str, text: str) -> None:
    """Raise ``ValueError`` for a JSON schema in a ``json_schema`` or ``structural_tag``
    constraint with a keyword the grammar would not enforce (:mod:`radixkv.sampling.schema_check`)."""
    import json

    if kind == "json_schema":
        schemas = [(json.loads(text), "")]
    elif kind == "structural_tag":
        schemas = [(s, f"{where}: ") for s, where in structural_tag_schemas(json.loads(text))]
    else:
        return
    for schema, where in schemas:
        problem = unenforced_keyword(schema)
        if problem is not None:
            raise ValueError(where + problem)


def _parse(kind: str, text: str) -> Any:
    """The ``xgrammar.Grammar`` of one constraint (see ``SamplingParams.structured_output``)."""
    xgr = _xgr()
    _check_schemas(kind, text)
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        if regex_lookaround(text):
            raise ValueError("lookahead / lookbehind ((?= (?! (?<= (?<!) is not supported: the grammar would drop it")
        return xgr.Grammar.from_regex(text)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(text)
    if kind == "choice":
        import json

        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(text)
    raise ValueError(f"unknown structured-output kind {kind!r}")


class GrammarState:
    """One sample's grammar matcher (an ``xgrammar.GrammarMatcher`` of a compiled grammar).

    Attributes:
        matcher: the xgrammar matcher (advanced on every accepted token).
    """

    __slots__ = ("matcher", "stuck")

    def __init__(self, matcher: Any) -> None:
        self.stuck = False  # no token is accepted any more: the request stops there
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 CPU, xgrammar's layout);
        False when every token is allowed (nothing to apply)."""
        return bool(self.matcher.fill_next_token_bitmask(bitmask, row))

    def accept(self, token_id: int) -> bool:
        """Advance on ``token_id``; False when the grammar does not allow it (the matcher is
        left unchanged)."""
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and a stop token (EOS) was accepted, or it is stuck."""
        return self.stuck or bool(self.matcher.is_terminated())


class GrammarBackend:
    """Validation, background compilation and caches of the constraints of one engine.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: the tokens that end a sample (the engine's EOS ids); a grammar allows
            them only where it may end.
        cache_size: compiled (and parsed) grammars kept, least recently used dropped first.
        max_threads: threads xgrammar's compiler may use (default: half the CPUs, at least 1,
            so a compile leaves the forward pass a core).

    Thread safety: :meth:`validate` and :meth:`compile` may be called from any thread; compiling
    runs on one background thread (``radixkv-grammar``).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_size: int = 128,
        max_threads: Optional[int] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = int(cache_size)
        self.max_threads = max_threads or max(1, (os.cpu_count() or 2) // 2)
        self._lock = threading.Lock()
        # NOTE: keyed by (namespace_key, kind, text): a cache shared by tenants is a side channel
        # (a compile skipped answers ~250 ms sooner, telling one tenant another sent that schema)
        self._parsed: "OrderedDict[Tuple[bytes, str, str], Any]" = OrderedDict()
        self._compiled: "OrderedDict[Tuple[bytes, str, str], Future]" = OrderedDict()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pid = os.getpid()  # the process whose thread the executor's is (a fork's child has none)
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on the compile thread
        self.num_compiles = 0  # grammars actually compiled (cache misses)

    # ------------------------------------------------------------------ validation
    def validate(self, structured: Tuple[str, str], namespace: Any = None) -> None:
        """Parse a constraint (``SamplingParams.structured_output``); raise
        :class:`~radixkv.errors.RequestError` (``param`` = the field) with xgrammar's message when
        it is invalid. Cached by ``namespace`` (the request's) and canonical text."""
        self._grammar(_key(structured, namespace))

    def _grammar(self, key: Tuple[bytes, str, str]) -> Any:
        with self._lock:
            g = self._parsed.get(key)
            if g is not None:
                self._parsed.move_to_end(key)
                return g
        try:
            g = _parse(key[1], key[2])
        except ImportError as e:
            raise RequestError(f"{key[1]}: structured outputs need xgrammar>=0.2.9,<0.3 ({e})", key[1]) from None
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise RequestError(f"invalid {key[1]}: {_message(e)}", key[1]) from None
        with self._lock:
            self._parsed[key] = g
            while len(self._parsed) > self.cache_size:
                self._parsed.popitem(last=False)
        return g

    # ------------------------------------------------------------------ compilation
    def compile(self, structured: Tuple[str, str], namespace: Any = None) -> Future:
        """A ``Future`` of the compiled grammar (``xgrammar.CompiledGrammar``) of a validated
        constraint: the one cached for ``namespace`` (the request's prefix-cache namespace: None,
        a ``Namespace`` or any hashable ``Namespace.of`` accepts), or a compile queued on the
        background thread."""
        key = _key(structured, namespace)
        if self._pid != os.getpid():
            self._after_fork()
        with self._lock:
            fut = self._compiled.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._compiled.move_to_end(key)
                return fut
        grammar = self._grammar(key)
        with self._lock:
            fut = self._compiled.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                return fut
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-grammar")
            fut = self._executor.submit(self._compile, grammar)
            self._compiled[key] = fut
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return fut

    def _after_fork(self) -> None:
        """In a forked child: a fork copies only the forking thread, so the copied executor has
        no thread and (believing it idle) starts none: a compile queued on it never ran. Drop it,
        and the compiles it had not finished (never to finish here); the next starts a new one."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._executor, self._pid = None, os.getpid()
        for key in [k for k, f in self._compiled.items() if not f.done()]:
            del self._compiled[key]

    def _compile(self, grammar: Any) -> Any:
        """Compile on the background thread (the tokenizer info is built at the first call)."""
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        self.num_compiles += 1
        return self._compiler.compile_grammar(grammar)

    def matcher(self, compiled: Any) -> GrammarState:
        """A fresh :class:`GrammarState` of a compiled grammar (one per sample)."""
        return GrammarState(_xgr().GrammarMatcher(compiled))

    def shutdown(self) -> None:
        """Stop the compile thread (pending compiles are cancelled); compiling starts it again."""
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- masks
def batch_matcher() -> Any:
    """A new ``xgrammar.BatchGrammarMatcher`` (a thread pool of half the CPUs, at least 1) for
    :func:`fill_bitmasks`; one per sampling pipeline, used by one thread at a time."""
    return _xgr().BatchGrammarMatcher(max(1, (os.cpu_count() or 2) // 2))


def fill_bitmasks(states: Sequence[GrammarState], bitmask: torch.Tensor, rows: Sequence[int], batch: Any) -> None:
    """Write each state's allowed next tokens into ``bitmask[rows[i]]`` (int32 CPU,
    ``[>= max(rows) + 1, ceil(V / 32)]``, xgrammar's layout) in one call of xgrammar's
    ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` on ``batch`` (:func:`batch_matcher`),
    instead of one Python call per row."""
    if len(states) == 1:
        states[0].matcher.fill_next_token_bitmask(bitmask, rows[0])
    elif states:
        batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, list(rows))


def accept_tokens(states: Sequence[GrammarState], tokens: Sequence[int]) -> List[bool]:
    """Advance each state on its token (xgrammar's ``batch_accept_token``, one call); per state
    False when its grammar does not allow the token (that matcher is left unchanged)."""
    if len(states) == 1:
        return [states[0].accept(tokens[0])]
    if not states:
        return []
    return _xgr().BatchGrammarMatcher.batch_accept_token([s.matcher for s in states], [int(t) for t in tokens])


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: List[int]) -> None:
    """``logits[r, j] = -inf`` for each row ``r`` of ``rows`` and each token ``j`` its bitmask
    row disallows (``bitmask[r]``, int32 CPU). CPU float32 logits use the native AVX2 kernel
    (:func:`radixkv.kernels.cpu.apply_token_bitmask_`); anything else xgrammar's
    ``apply_token_bitmask_inplace`` (its Triton kernel on CUDA)."""
    if not rows:
        return
    if cpu_kernels.AVAILABLE and logits.device.type == "cpu" and logits.dtype == torch.float32:
        if logits.stride(1) == 1:
            cpu_kernels.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
            return
    bm = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(logits, bm, vocab_size=logits.shape[1], indices=list(rows))


# ---------------------------------------------------------------------- tool calls
def tool_call_structural_tag(
    tools: Sequence[Dict[str, Any]],
    *,
    name: Optional[str] = None,
    parallel: bool = True,
    begin: str = "<tool_call>\n",
    end: str = "\n</tool_call>",
    separator: str = "\n",
) -> Dict[str, Any]:
    """An xgrammar structural tag (for ``SamplingParams.structural_tag``) that makes the output one
    or more tool calls in the Hermes / Qwen form and nothing else::

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    ``arguments`` is constrained by the function's ``parameters`` JSON schema (unconstrained JSON
    when it has none); ``name`` is one of the tools' names. For OpenAI's ``tool_choice:
    "required"`` pass every tool; for a named tool choice pass ``name`` (only that function).
    ``parallel=False`` allows exactly one call (``parallel_tool_calls: false``), else calls are
    separated by ``separator``. The sample ends (EOS, ``"stop"``) after the last call.

    Args:
        tools: OpenAI tool definitions (``{"type": "function", "function": {"name", "parameters"}}``)
            or bare function definitions (``{"name", "parameters"}``).
        name: restrict to this function.
        parallel: allow several calls.
        begin, end, separator: the markers around and between calls.

    Returns:
        The structural tag as a JSON-ready dict.

    Raises:
        RequestError: no tools, a tool without a name or whose ``parameters`` are not a schema
            of ``"type": "object"`` (the arguments are a JSON object), or ``name`` not among them
            (``param`` "tools" / "tool_choice").
    """
    funcs = []
    for t in tools:
        f = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise RequestError(f"each tool needs a function with a name, got {t!r}", "tools")
        funcs.append(f)
    if name is not None:
        funcs = [f for f in funcs if f["name"] == name]
        if not funcs:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    if not funcs:
        raise RequestError("a constrained tool call needs at least one tool", "tools")
    import json

    tags = []
    for f in funcs:
        params = f.get("parameters")
        schema = params if isinstance(params, dict) and params else {"type": "object"}
        if schema.get("type") != "object":  # arguments are a JSON object: the parser reads no other
            raise RequestError(
                f'tool {f["name"]!r}: parameters must be a JSON schema of type "object", got {params!r}', "tools"
            )
        prefix = begin + '{"name": ' + json.dumps(f["name"], ensure_ascii=False) + ', "arguments": '
        tags.append(
            {
                "type": "tag",
                "begin": prefix,
                "content": {"type": "json_schema", "json_schema": schema},
                "end": "}" + end,
            }
        )
    fmt: Dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    return {"type": "structural_tag", "format": fmt}


def tool_calls_or(calls: Dict[str, Any], kind: str, text: str) -> Dict[str, Any]:
    """An xgrammar structural tag whose output is either ``calls`` (a structural tag of one or
    more tool calls, :func:`tool_call_structural_tag`'s) or text under the constraint ``(kind,
    text)`` (:attr:`~radixkv.sampling_params.SamplingParams.structured_output`'s pair), with the
    same grammar as that constraint alone: OpenAI's ``tool_choice: "auto"`` with a
    ``response_format``, where the model either calls tools or answers in the format.

    Raises:
        RequestError: the constraint does not parse (``param``: ``kind``).
    """
    fmt = {"type": "or", "elements": [calls["format"], {"type": "grammar", "grammar": _grammar_text(kind, text)}]}
    return {"type": "structural_tag", "format": fmt}


@functools.lru_cache(maxsize=128)
def _grammar_text(kind: str, text: str) -> str:
    """The EBNF text of one constraint's grammar (kept by canonical text: an agent sends the same
    schema with every request).

    Raises:
        RequestError: the constraint does not parse (``param``: ``kind``; not cached).
    """
    try:
        return str(_parse(kind, text))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses
        raise RequestError(f"{kind}: {_XGR_PREFIX.sub('', str(e)).strip()}", kind) from None
