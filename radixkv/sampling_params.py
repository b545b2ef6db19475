"""`SamplingParams`: how one request is decoded (vLLM's field names, validated on construction).

docs/sampling.md has the semantics of the penalties, logprobs and structured-output fields.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import math
import numbers
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from radixkv.errors import RequestError
from radixkv.namespace import check_cache_salt
from radixkv.text import check_text

MAX_LOGPROBS = 20
"""The most top alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (vLLM's default
``max_logprobs``; OpenAI's chat ``top_logprobs`` limit)."""

MAX_STOP_STRINGS = 256
"""The most stop strings a request may give. Each generated token is checked against every one
on the engine thread, so an unbounded list (a million strings fit in a 32 MiB body) slowed every
request's steps; OpenAI's own limit is 4."""

MAX_STOP_CHARS = 1024
"""The longest stop string, in characters (a stream holds back up to this many characters)."""

MAX_SCHEMA_DEPTH = 128
"""The deepest nesting (JSON objects and arrays) of a ``json_schema`` or ``structural_tag``: a
deeper one raised RecursionError (not a ValueError) and a few hundred levels held the caller's
thread in xgrammar's parse for seconds; the server's body parser refuses deeper bodies anyway."""

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds a request may give (a signed 64-bit integer, the range ``torch.Generator`` takes
with room for the ``seed + i`` of sample ``i`` when ``n > 1``)."""


class _DefaultMaxTokens(int):
    """The default of ``max_tokens`` (16), told apart from an explicit 16 so that giving both
    ``max_tokens`` and its alias ``max_new_tokens`` is refused."""


_DEFAULT_MAX_TOKENS = _DefaultMaxTokens(16)

STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")
"""The structured-output fields; at most one is set per request."""


_INT_FIELDS = (
    ("n", "max_tokens", "top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs", "logprob_start_len")
    + ("output_kind",)  # a RequestOutputKind is an int already: kept
)
_DECIMAL = re.compile(r"-?[0-9]+")
"""A token id as a JSON object key (``logit_bias``): ASCII digits, an optional minus."""

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class RequestOutputKind(enum.IntEnum):
    """What ``AsyncLLM.generate`` yields for a request (vLLM's ``RequestOutputKind``):
    ``CUMULATIVE`` (each output holds everything generated so far), ``DELTA`` (only what is new
    since the last one yielded) or ``FINAL_ONLY`` (the final output alone). ``LLM.generate``
    returns final outputs whatever the kind, as vLLM's does."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


#: temperatures below this decode greedily (argmax), as in vLLM (its ``_SAMPLING_EPS``)
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Decoding parameters of one request (names and defaults follow vLLM's ``SamplingParams``).

    Attributes:
        n: number of samples drawn for the prompt (>= 1; the engine refuses more than its
            ``EngineConfig.max_n``, 128 by default). The prompt is prefilled once and the ``n``
            samples share its KV (see docs/engine.md, "n > 1").
        max_tokens: maximum number of generated tokens per sample (>= 1, default 16), or None:
            as many as the prompt leaves of the context (vLLM's None), i.e. up to
            ``max_context_len`` (and the KV pool's size) minus the prompt, set when the request is
            submitted. The prompt plus ``max_tokens`` must fit the engine's context
            (``max_context_len``), checked when the request is submitted. ``max_new_tokens`` (SGLang's name) is accepted as an
            alias in the constructor; giving both is an error.
        temperature: softmax temperature (>= 0); 0 means greedy (argmax).
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top probability, in [0, 1].
        seed: seed of the request's own ``torch.Generator`` (a signed 64-bit integer); the same
            seed gives the same tokens.
        stop: a stop string or a list of them (at most :data:`MAX_STOP_STRINGS` non-empty strings
            of at most :data:`MAX_STOP_CHARS` characters); generation stops when the
            detokenized text contains one, and the text is truncated before it (the stop string
            is not included unless ``include_stop_str_in_output``); ``stop_reason`` is the string.
        stop_token_ids: a list of extra token ids that end generation (the token is kept in
            ``token_ids``, its text left out of ``text`` unless ``include_stop_str_in_output``;
            ``stop_reason`` is the id); ids outside the vocabulary are refused when the request
            is submitted.
        include_stop_str_in_output: (bool) keep the matched stop string in ``text`` (cut after it
            instead of before it), and the text of a stop token (``stop_token_ids``, EOS), which
            is otherwise left out of ``text`` (it stays in ``token_ids``), as vLLM does.
        ignore_eos: (bool) keep generating after the model's end-of-sequence token.
        skip_special_tokens: (bool) drop special tokens when detokenizing.
        detokenize: (bool, default True) False: no text at all (vLLM's): ``text`` stays ``""``
            and logprobs' ``decoded_token`` None, token ids only; stop strings need it True.
        presence_penalty: OpenAI's presence penalty in [-2, 2]: subtracted once from the logit
            of every token the sample has generated so far.
        frequency_penalty: OpenAI's frequency penalty in [-2, 2]: subtracted from a token's logit
            once per time the sample has generated it.
        repetition_penalty: Hugging Face's / vLLM's repetition penalty (> 0, 1 = off, CTRL,
            Keskar et al. 2019): the logit of every token in the prompt or the output so far is
            divided by it when positive, multiplied by it when negative.
        logit_bias: token id -> bias in [-100, 100], added to that token's logit (OpenAI's
            ``logit_bias``; keys may be ints or decimal strings, stored as ints).
        allowed_token_ids: None, or a non-empty list of token ids: only these may be generated
            (vLLM's; every other token's logit is ``-inf``); ids outside the vocabulary are
            refused when the request is submitted.
        min_tokens: EOS and ``stop_token_ids`` are masked until the sample has this many tokens
            (0..max_tokens), and a stop string counts only when it ends in a token after them.
        logprobs: None (off) or 0..20: return, per generated token, its log-probability and
            rank plus this many most likely alternatives (of the raw model distribution).
        prompt_logprobs: None (off) or 0..20: the same for every prompt position from
            ``logprob_start_len`` on, computed in the prompt's own prefill forward.
        logprob_start_len: first prompt position that gets prompt logprobs (SGLang's name;
            default 0 when ``prompt_logprobs`` is set; only with ``prompt_logprobs``). The
            request reuses at most ``max(logprob_start_len - 1, 0)`` tokens of prefix cache.
        json_schema: constrain the output to JSON valid under this schema (a dict or its JSON
            text), compiled by xgrammar (formatted with ``", "`` / ``": "`` separators, no
            other whitespace; properties in schema order; no properties beyond the schema's).
        json_object: constrain the output to a JSON object (OpenAI's ``json_object`` mode).
        regex: constrain the output to a full match of this regex (xgrammar's dialect).
        grammar: constrain the output to this EBNF grammar (xgrammar's GBNF dialect, root rule
            ``root``).
        choice: constrain the output to exactly one of these strings.
        structural_tag: an xgrammar structural tag (dict or JSON text, ``{"type":
            "structural_tag", "format": {...}}``), e.g. tool calls (docs/sampling.md).
        output_kind: a :class:`RequestOutputKind` (or its int value): what
            ``AsyncLLM.generate`` streams, cumulative outputs (the default), deltas or the final
            output only.
        cache_salt: None, or a prefix-cache salt (a non-empty str of at most 128 characters,
            vLLM's ``cache_salt``): the request shares cached prefixes only with requests of the
            same salt (and namespace); it joins the request's namespace
            (:func:`radixkv.namespace.with_salt`; another salt already there is an error).

    A field may be set after construction (``sp.logprobs = 5``, as vLLM code does): the engine
    validates the current values when the request is submitted (:meth:`checked`); setting a name
    that is not a field is a RequestError, as the constructor's.

    At most one of the structured-output fields may be set; a constrained sample finishes with
    ``"stop"`` when its grammar is complete and the model emits EOS (EOS is masked before).

    Raises:
        RequestError: a ValueError naming the field (``.param``) and the allowed range, for any
            invalid value.
    """

    n: int = 1
    max_tokens: Optional[int] = _DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Dict[int, float]] = None
    allowed_token_ids: Optional[Sequence[int]] = None
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logprob_start_len: Optional[int] = None
    json_schema: Union[None, str, Dict[str, Any]] = None
    json_object: bool = False
    regex: Optional[str] = None
    grammar: Optional[str] = None
    choice: Optional[List[str]] = None
    structural_tag: Union[None, str, Dict[str, Any]] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    cache_salt: Optional[str] = field(default=None, repr=False)
    max_new_tokens: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            if self.max_tokens is not _DEFAULT_MAX_TOKENS:
                raise RequestError(
                    f"give only one of max_tokens ({self.max_tokens!r}) and its alias max_new_tokens "
                    f"({self.max_new_tokens!r})",
                    "max_new_tokens",
                )
            self.max_tokens = self.max_new_tokens
            self.max_new_tokens = None
        elif self.max_tokens is _DEFAULT_MAX_TOKENS:
            self.max_tokens = 16
        self._numbers_as_python()
        self.stop = _string_list(self.stop, "stop")
        self.stop_token_ids = _int_list(self.stop_token_ids, "stop_token_ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids or min(self.allowed_token_ids) < 0:
                raise RequestError(
                    f"allowed_token_ids must be None or a non-empty list of token ids >= 0, got {self.allowed_token_ids}",
                    "allowed_token_ids",
                )
        self._validate()
        self._validate_processors()
        self._structured = self._validate_structured()
        self._uses_penalties = (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )
        self._uses_processors = (
            self._uses_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
        )
        # False: the sampler alone serves the request (no processor, grammar or logprobs)
        self._needs_pipeline = self._uses_processors or self._structured is not None or self.logprobs is not None
        # the values validated (``checked``: a field set after construction is validated at submit time)
        object.__setattr__(self, "_validated", copy.deepcopy(self._values()))

    def _values(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "max_new_tokens"}

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self.__dataclass_fields__:
            _refuse(name)  # e.g. ``sp.best_of = 2`` would be ignored
        object.__setattr__(self, name, value)

    def checked(self) -> "SamplingParams":
        """These params as validated: itself, or, when a field was set after construction (as
        vLLM code does, ``sp.logprobs = 5``), a validated copy of its current values (the flags
        derived at construction, e.g. whether it needs logits processing, would miss the change).

        Raises:
            RequestError: the current values are invalid (naming the field).
        """
        values = self._values()
        try:
            same = values == self._validated  # a value set to an array compares elementwise
        except (TypeError, ValueError):
            same = False
        if same and self.max_new_tokens is None:
            return self
        if self.prompt_logprobs is None and self._validated["prompt_logprobs"] is not None:
            if values["logprob_start_len"] == self._validated["logprob_start_len"]:
                values["logprob_start_len"] = None  # the default it got with prompt_logprobs
        if self.max_new_tokens is not None and values["max_tokens"] == self._validated["max_tokens"]:
            values["max_tokens"] = _DEFAULT_MAX_TOKENS  # the alias set alone
        return SamplingParams(**values, max_new_tokens=self.max_new_tokens)

    def _numbers_as_python(self) -> None:
        """numpy (or other) integer / real scalars as int / float, as vLLM takes them
        (``max_tokens=np.int64(8)``); each field's range is checked after."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
                setattr(self, name, float(v))

    def _validate(self) -> None:
        is_int = _is_int

        if not (is_int(self.output_kind) and 0 <= self.output_kind <= 2):
            raise RequestError(
                f"output_kind must be a RequestOutputKind (CUMULATIVE 0, DELTA 1, FINAL_ONLY 2), got {self.output_kind!r}",
                "output_kind",
            )
        self.output_kind = RequestOutputKind(self.output_kind)

        if not is_int(self.n) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise RequestError(
                f"max_tokens must be None (up to the context length) or an integer >= 1, got {self.max_tokens!r}",
                "max_tokens",
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k) or self.top_k < -1:
            raise RequestError(
                f"top_k must be -1 (disabled), 0 (disabled) or an integer >= 1, got {self.top_k!r}", "top_k"
            )
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        lo, hi = SEED_RANGE
        if self.seed is not None and (not is_int(self.seed) or not lo <= self.seed <= hi):
            raise RequestError(f"seed must be None or an integer in [-2**63, 2**63 - 1], got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", "stop")
        for s in self.stop:
            if not s:
                raise RequestError(f"stop must hold non-empty strings, got {s!r}", "stop")
            if len(s) > MAX_STOP_CHARS:
                raise RequestError(f"stop strings are at most {MAX_STOP_CHARS} characters, got {len(s)}", "stop")
            check_text(s, "stop")
        for t in self.stop_token_ids:
            if t < 0:
                raise RequestError(f"stop_token_ids must be token ids >= 0, got {t}", "stop_token_ids")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        if self.stop and not self.detokenize:
            raise RequestError("stop strings need detokenize=True (they are matched in the text)", "stop")
        check_cache_salt(self.cache_salt)

    def _validate_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}", name)
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise RequestError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}", "repetition_penalty"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError(
                    f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}", "logit_bias"
                )
            bias: Dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = _as_int(k)
                except (TypeError, ValueError):
                    raise RequestError(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
                if tok < 0:
                    raise RequestError(f"logit_bias keys must be token ids >= 0, got {k!r}", "logit_bias")
                if not _is_number(v) or not -100.0 <= v <= 100.0:
                    raise RequestError(
                        f"logit_bias values must be numbers in [-100, 100], got {v!r} for {k!r}", "logit_bias"
                    )
                if tok in bias:  # "28" and "028": one of the two biases would be dropped
                    raise RequestError(f"logit_bias names token id {tok} twice (key {k!r})", "logit_bias")
                bias[tok] = float(v)
            self.logit_bias = bias
        top = self.max_tokens if self.max_tokens is not None else math.inf
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= top:
            raise RequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}", name)
        s = self.logprob_start_len
        if s is not None:
            if not _is_int(s) or s < 0:
                raise RequestError(f"logprob_start_len must be an integer >= 0, got {s!r}", "logprob_start_len")
            if self.prompt_logprobs is None:
                raise RequestError("logprob_start_len needs prompt_logprobs (0..20) to be set", "logprob_start_len")
        elif self.prompt_logprobs is not None:
            self.logprob_start_len = 0

    def _validate_structured(self) -> Optional[Tuple[str, str]]:
        """Check the structured-output fields' types; returns ``(field, canonical text)`` of the
        one that is set, or None. xgrammar checks the contents when the engine accepts the
        request (:meth:`radixkv.engine.Engine.add_request`)."""
        if not isinstance(self.json_object, bool):
            raise RequestError(f"json_object must be a boolean, got {self.json_object!r}", "json_object")
        given = [
            name
            for name in STRUCTURED_FIELDS
            if (getattr(self, name) is not None if name != "json_object" else self.json_object)
        ]
        if len(given) > 1:
            raise RequestError(
                f"at most one structured-output field may be set ({', '.join(STRUCTURED_FIELDS)}); got "
                f"{' and '.join(given)}",
                given[1],
            )
        if not given:
            return None
        name = given[0]
        value = getattr(self, name)
        if name in ("json_schema", "structural_tag"):
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise RequestError(f"{name} is not valid JSON: {e}", name) from None
                except RecursionError:
                    raise RequestError(f"{name} nests deeper than at most {MAX_SCHEMA_DEPTH} levels", name) from None
            if _depth(value) > MAX_SCHEMA_DEPTH:
                raise RequestError(f"{name} nests deeper than at most {MAX_SCHEMA_DEPTH} levels", name)
            if name == "json_schema" and not isinstance(value, (dict, bool)):
                raise RequestError(f"json_schema must be a JSON object (or boolean), got {type(value).__name__}", name)
            if name == "structural_tag" and not isinstance(value, dict):
                raise RequestError(f"structural_tag must be a JSON object, got {type(value).__name__}", name)
            try:
                text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise RequestError(f"{name} is not JSON-serializable: {e}", name) from None
            return name, text
        if name == "json_object":
            return name, ""
        if name in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise RequestError(f"{name} must be a non-empty string, got {value!r}", name)
            return name, value
        # choice
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            raise RequestError(f"choice must be a non-empty list of strings, got {value!r}", name)
        for c in value:
            if not isinstance(c, str):
                raise RequestError(f"choice must hold strings, got {c!r}", name)
        self.choice = list(value)
        return name, json.dumps(self.choice, ensure_ascii=False)

    @property
    def structured_output(self) -> Optional[Tuple[str, str]]:
        """``(field, canonical text)`` of the structured-output constraint, or None: the field
        name (``"json_schema"``, ``"json_object"``, ``"regex"``, ``"grammar"``, ``"choice"``,
        ``"structural_tag"``) and its text (JSON fields as compact JSON keeping key order, the
        choices as a JSON list). The grammar compiler caches by this pair."""
        return self._structured

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature below :data:`GREEDY_TEMPERATURE` (1e-5, as
        vLLM's sampler; dividing logits by a smaller one overflows float32)."""
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes) -> "SamplingParams":
        """A validated copy with some fields changed."""
        values = self._values()
        if changes.get("prompt_logprobs", 0) is None and "logprob_start_len" not in changes:
            values["logprob_start_len"] = None
        values.update(changes)
        return SamplingParams(**values)


_VLLM_HINTS = {
    "best_of": "not supported: ask for n samples and pick one",
    "guided_decoding": "give the constraint directly: json_schema=, regex=, choice=, grammar=, json_object=, "
    "structural_tag=",
    "structured_outputs": "give the constraint directly: json_schema=, regex=, choice=, grammar=, json_object=, "
    "structural_tag=",
    "logits_processors": "not supported: use logit_bias, allowed_token_ids, min_tokens, the penalties or a "
    "structured-output field",
}


def _refuse_unknown(init):
    """``SamplingParams.__init__`` refusing an unknown keyword with a RequestError (a ValueError)
    naming it, instead of the dataclass's TypeError, with a hint for vLLM's fields radixkv lacks."""

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            _refuse(*unknown)
        init(self, *args, **kwargs)

    return __init__


def _depth(value: Any) -> int:
    """How deep JSON objects / arrays nest in ``value`` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _refuse(*unknown: str) -> None:
    """Raise the RequestError naming keywords (or attributes) that are not fields, with a hint
    for vLLM's fields radixkv lacks."""
    hints = "; ".join(f"{k}: {_VLLM_HINTS[k]}" for k in unknown if k in _VLLM_HINTS)
    raise RequestError(
        f"SamplingParams does not take {', '.join(unknown)}"
        + (f" ({hints})" if hints else " (not supported by radixkv)")
        + f"; its fields: {', '.join(f for f in SamplingParams.__dataclass_fields__ if f != 'max_new_tokens')}",
        unknown[0],
    )


SamplingParams.__init__ = _refuse_unknown(SamplingParams.__init__)  # type: ignore[method-assign]


def _string_list(value: Any, name: str) -> List[str]:
    """``value`` (None, a str, or a list / tuple of str) as a list of str; else RequestError."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise RequestError(f"{name} must be a string or a list of strings, got {value!r}", name)


def _int_list(value: Any, name: str) -> List[int]:
    """``value`` (None, or a list / tuple of integers) as a list of int; else RequestError."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        try:
            return [_as_int(v, strings=False) for v in value]
        except ValueError:
            pass
    raise RequestError(f"{name} must be a list of integer token ids, got {value!r}", name)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _as_int(x: Any, strings: bool = True) -> int:
    """An int from an integer (not a bool; numpy integers too) or, with ``strings``, a decimal
    string of ASCII digits (JSON object keys; not other Unicode digits nor whitespace, which
    ``int`` takes); else ValueError."""
    if isinstance(x, str) and strings:
        if _DECIMAL.fullmatch(x):
            return int(x)
        raise ValueError(x)
    if isinstance(x, bool):
        raise ValueError(x)
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(x) from None
