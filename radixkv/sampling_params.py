"""`SamplingParams`: how one request is decoded (vLLM's field names, validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from radixkv.errors import RequestError


@dataclass
class SamplingParams:
    """Decoding parameters of one request (names and defaults follow vLLM's ``SamplingParams``).

    Attributes:
        n: number of samples drawn for the prompt (>= 1). The prompt is prefilled once and the
            ``n`` samples share its KV (see docs/engine.md, "n > 1").
        max_tokens: maximum number of generated tokens per sample (>= 1, default 16).
            ``max_new_tokens`` is accepted as an alias in the constructor.
        temperature: softmax temperature (>= 0); 0 means greedy (argmax).
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top probability, in [0, 1].
        seed: seed of the request's own ``torch.Generator``; the same seed gives the same tokens.
        stop: stop strings; generation stops when the detokenized text contains one, and the
            text is truncated before it (the stop string is not included).
        stop_token_ids: extra token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: keep generating after the model's end-of-sequence token.
        skip_special_tokens: drop special tokens when detokenizing.

    Raises:
        RequestError: a ValueError naming the field (``.param``) and the allowed range, for any
            invalid value.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    max_new_tokens: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            self.max_tokens = self.max_new_tokens
            self.max_new_tokens = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self._validate()

    def _validate(self) -> None:
        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k) or self.top_k < -1:
            raise RequestError(
                f"top_k must be -1 (disabled), 0 (disabled) or an integer >= 1, got {self.top_k!r}", "top_k"
            )
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and not is_int(self.seed):
            raise RequestError(f"seed must be an integer or None, got {self.seed!r}", "seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop must hold non-empty strings, got {s!r}", "stop")
        for t in self.stop_token_ids:
            if t < 0:
                raise RequestError(f"stop_token_ids must be >= 0, got {t}", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        """A validated copy with some fields changed."""
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "max_new_tokens"}
        values.update(changes)
        return SamplingParams(**values)
