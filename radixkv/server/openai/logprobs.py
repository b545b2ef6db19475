"""Token logprobs in OpenAI's two response shapes, from the engine's per-token
``{token id: Logprob(logprob, rank, decoded_token)}`` dicts (``CompletionOutput.logprobs``,
``RequestOutput.prompt_logprobs``).

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}``; ``top_logprobs`` holds the ``k`` most likely tokens by rank (the sampled
  token among them only when it ranks within ``k``).
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token text: logprob}],
  "text_offset"}``; each ``top_logprobs`` dict holds the ``k`` most likely tokens and the
  sampled one.

``bytes`` are the token's own bytes: for byte-level BPE vocabularies (GPT-2 style, SmolLM2's)
the vocabulary string mapped back through the byte-to-unicode table, so a character split over
several tokens is recovered by joining their bytes; otherwise the UTF-8 of the token's text.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Mapping, Optional, Sequence

from radixkv.server.openai.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs", "prompt_logprobs_json"]

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` table (every byte to a printable character)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenText:
    """Per-token text and bytes of one tokenizer (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.byte_level = "Ġ" in vocab or "Ċ" in vocab  # GPT-2's encodings of " " and "\n"

    def __call__(self, token_id: int, decoded: Optional[str] = None) -> tuple[str, list[int]]:
        """(text, bytes) of ``token_id``; ``decoded`` is the engine's text of it, if any."""
        if token_id not in self._cache:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            table = _unicode_to_byte()
            if self.byte_level and isinstance(piece, str) and piece and all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
            elif isinstance(piece, str) and _BYTE_PIECE.fullmatch(piece):  # sentencepiece byte fallback
                raw = bytes([int(piece[3:5], 16)])
            else:
                text = self.tokenizer.decode([int(token_id)])
                raw = text.encode("utf-8")
            if decoded is None:
                decoded = self.tokenizer.decode([int(token_id)])
            self._cache[token_id] = (decoded, list(raw))
        text, raw = self._cache[token_id]
        return (decoded if decoded is not None else text), raw


def _finite(x: float) -> float:
    """OpenAI's floor for impossible tokens (-inf is not JSON)."""
    return max(float(x), -9999.0) if not math.isnan(x) else -9999.0


def _ranked(entry: Mapping[int, Any], k: int) -> list[tuple[int, Any]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]], k: int, text: TokenText
) -> ChoiceLogprobs:
    """Chat ``choice.logprobs`` for the generated ``token_ids`` (one engine dict each)."""
    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry[tid]
        tok, raw = text(tid, lp.decoded_token)
        tops = []
        for t, alt in _ranked(entry, k):
            t_tok, t_raw = text(t, alt.decoded_token)
            tops.append(TopLogprob(token=t_tok, logprob=_finite(alt.logprob), bytes=t_raw))
        content.append(TokenLogprob(token=tok, logprob=_finite(lp.logprob), bytes=raw, top_logprobs=tops))
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[Optional[Mapping[int, Any]]],
    k: int,
    text: TokenText,
    offset: int = 0,
) -> CompletionLogprobs:
    """Completions ``choice.logprobs`` for ``token_ids`` (an entry of None, the first prompt
    token's, gives null logprobs); ``offset`` is the text offset of the first token."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        if entry is None:
            tok, _ = text(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            lp = entry[tid]
            tok, _ = text(tid, lp.decoded_token)
            out.tokens.append(tok)
            out.token_logprobs.append(_finite(lp.logprob))
            tops = {text(t, alt.decoded_token)[0]: _finite(alt.logprob) for t, alt in _ranked(entry, k)}
            tops.setdefault(tok, _finite(lp.logprob))
            out.top_logprobs.append(tops)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def prompt_logprobs_json(
    prompt_logprobs: Optional[Sequence[Optional[Mapping[int, Any]]]],
    text: TokenText,
    k: Optional[int] = None,
    token_ids: Optional[Sequence[int]] = None,
) -> Optional[list[Optional[dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}``: the prompt token and the ``k`` most
    likely (all the engine's entries when ``k`` is None; the engine may hold more, e.g. for
    completions' ``echo`` with a larger ``logprobs``). ``token_ids``: the prompt's tokens."""
    if prompt_logprobs is None:
        return None

    def keep(i: int, t: int, lp: Any) -> bool:
        return k is None or (token_ids is not None and t == token_ids[i]) or (lp.rank is not None and lp.rank <= k)

    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": text(t, lp.decoded_token)[0]}
            for t, lp in entry.items()
            if keep(i, t, lp)
        }
        for i, entry in enumerate(prompt_logprobs)
    ]
