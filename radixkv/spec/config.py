"""`SpeculativeConfig`: the ``speculative_config`` of an engine (vLLM's shape), parsed and checked.

``EngineConfig(speculative_config=...)``, ``LLM(speculative_config=...)``, ``AsyncLLM(...)`` and
``radixkv serve|replay --speculative-config JSON`` take ``None`` (off, the default), a dict, its
JSON text or a :class:`SpeculativeConfig`::

    {"method": "radix", "num_speculative_tokens": 5}

A leaf module (no torch, no engine): :mod:`radixkv.config` imports it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any, Optional

__all__ = ["MAX_SPECULATIVE_TOKENS", "SPEC_METHODS", "SpeculativeConfig", "parse_speculative_config", "cli_arg"]

SPEC_METHODS = ("radix", "ngram")
"""``"ngram"``: prompt lookup over the request's own prompt and output, and its running siblings
(``n > 1``, identical prompts); ``"radix"``: that, plus the radix tree's continuation of the
request's sequence and a suffix index over recently finished sequences of its namespace."""

MAX_SPECULATIVE_TOKENS = 16
"""The cap on ``num_speculative_tokens``: a verify forward has at most 17 rows per request (the
fused CPU decode step serves 64 rows a forward; ``max_draft_tokens_per_step`` shares them)."""

_DEFAULT_SUFFIX_TOKENS = 65536
"""The default ``suffix_index_tokens`` (about 10 MB of index)."""

_DEFAULT_ROW_COST = 0.25
"""The default ``draft_row_cost``."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding without a draft model (docs/speculative.md).

    Attributes:
        method: ``"radix"`` or ``"ngram"`` (:data:`SPEC_METHODS`).
        num_speculative_tokens: the most draft tokens a request verifies in one forward,
            1 .. :data:`MAX_SPECULATIVE_TOKENS` (default 5).
        prompt_lookup_min: n-gram length a lookup must match (>= 1, default 2).
        prompt_lookup_max: the longest match a lookup measures when it ranks candidates
            (>= ``prompt_lookup_min``, default 8); longer matches win.
        adaptive: per request, the draft length follows its acceptance rate, down to no
            drafting when drafts do not pay (default True); False: always the longest draft
            the sources give, up to ``num_speculative_tokens``.
        grammar_drafts: with a structured output, the tokens the grammar forces are drafts and
            drafts the grammar refuses are cut (default True).
        suffix_index_tokens: tokens of recently finished sequences the cross-request suffix
            index keeps (``"radix"``; 0 turns it off; default 65536, about 10 MB; with
            ``"ngram"`` another value than 0 or the default is a ValueError: it would do nothing).
        draft_row_cost: the cost of one verify row relative to a one-row decode step, the
            adaptive rule's constant (in (0, 1], default 0.25): a request drafts ``k`` tokens
            while its acceptance rate ``a`` keeps ``a ** k >= draft_row_cost`` (another value than
            the default with ``adaptive`` off is a ValueError: it would do nothing).
        max_draft_tokens_per_step: draft tokens verified in one forward, all requests together
            (>= 1, default 48); the requests with the best acceptance rate draft first.
    """

    method: str
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 8
    adaptive: bool = True
    grammar_drafts: bool = True
    suffix_index_tokens: int = _DEFAULT_SUFFIX_TOKENS
    draft_row_cost: float = _DEFAULT_ROW_COST
    max_draft_tokens_per_step: int = 48

    def __post_init__(self) -> None:
        _check(self)

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_KEYS = tuple(f.name for f in fields(SpeculativeConfig))


def _int_in(cfg: SpeculativeConfig, name: str, lo: int, hi: Optional[int] = None) -> None:
    v = getattr(cfg, name)
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        limit = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"speculative_config.{name} must be an integer {limit}, got {v!r}")


def _check(cfg: SpeculativeConfig) -> None:
    """Raise ValueError naming the field (``speculative_config.<key>``) and its limit."""
    if cfg.method not in SPEC_METHODS:
        raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {cfg.method!r}")
    _int_in(cfg, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    _int_in(cfg, "prompt_lookup_min", 1, 64)
    _int_in(cfg, "prompt_lookup_max", cfg.prompt_lookup_min, 256)
    _int_in(cfg, "suffix_index_tokens", 0)
    if cfg.method != "radix" and cfg.suffix_index_tokens not in (0, _DEFAULT_SUFFIX_TOKENS):
        raise ValueError(
            f"speculative_config.suffix_index_tokens applies to method 'radix' only ({cfg.method!r} keeps no "
            f"suffix index), got {cfg.suffix_index_tokens}"
        )
    _int_in(cfg, "max_draft_tokens_per_step", 1)
    for name in ("adaptive", "grammar_drafts"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"speculative_config.{name} must be a bool, got {getattr(cfg, name)!r}")
    c = cfg.draft_row_cost
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1:
        raise ValueError(f"speculative_config.draft_row_cost must be a number in (0, 1], got {c!r}")
    if not cfg.adaptive and c != _DEFAULT_ROW_COST:
        raise ValueError(
            f"speculative_config.draft_row_cost applies only with adaptive true (the rule it sets), got {c!r}"
        )


def _unique_keys(pairs: list) -> dict:
    """``json.loads``' ``object_pairs_hook``: the object as a dict; a key given twice is a
    ValueError (JSON keeps the last one silently, so ``{"method": "radix", "method": "ngram"}``
    would drop a setting without a word)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"speculative_config: key {k!r} given twice in the JSON text")
        out[k] = v
    return out


def parse_speculative_config(value: Any) -> Optional[SpeculativeConfig]:
    """``value`` as a :class:`SpeculativeConfig`: None (off), a dict, its JSON text (``"null"``
    is off) or a ``SpeculativeConfig``.

    Raises:
        ValueError: naming the field: text that is not a JSON object, a key given twice in the
            text, an unknown key (the valid ones listed), a missing or unknown ``method``, a value
            out of its range.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    text = isinstance(value, str)
    if text:
        try:
            value = json.loads(value, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be a JSON object, got {value!r} ({e})") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        kind = f"JSON text of a {type(value).__name__}" if text else type(value).__name__
        raise ValueError(f"speculative_config must be None, a dict or its JSON text, got {kind}")
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; valid: {list(_KEYS)}")
    if "method" not in value:
        raise ValueError(f"speculative_config.method is required, one of {list(SPEC_METHODS)}")
    return SpeculativeConfig(**value)


CLI_HELP = (
    'speculative decoding as JSON, e.g. \'{"method": "radix", "num_speculative_tokens": 5}\' '
    "(methods radix, ngram; k from 1 to %d; docs/speculative.md) (default: off)" % MAX_SPECULATIVE_TOKENS
)
"""The help text of ``--speculative-config`` (``radixkv serve`` and ``radixkv replay``)."""


def cli_arg(text: str) -> Optional[SpeculativeConfig]:
    """The ``--speculative-config JSON`` flag's ``type=``: :func:`parse_speculative_config` of
    ``text``; its ValueError becomes argparse's error (exit code 2, the field named)."""
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
