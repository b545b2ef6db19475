"""Logprobs of sampled and prompt tokens, and their top-k alternatives.

Distribution: the raw model distribution, ``log_softmax`` of the model's float32 logits at that
position, before the grammar mask, logit_bias, min_tokens, penalties and temperature (vLLM's
default ``logprobs_mode="raw_logprobs"``; SGLang's default too). A token that a grammar or a
processor made impossible keeps its model logprob. Rank: 1 + the number of tokens with a
strictly higher logprob (vLLM's rank; ties share the better rank).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch

from radixkv.outputs import Logprob

__all__ = ["TokenLogprobs", "TokenDecoder", "token_bytes", "token_logprobs", "to_position_logprobs"]

_BLOCK = 256  # rows per log_softmax (bounds the temporary for long prompt-logprob chunks)


class TokenLogprobs(NamedTuple):
    """One position: the actual token's logprob and rank, and the top-``k`` alternatives
    (ids and logprobs, most likely first)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: List[int]
    top_logprobs: List[float]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> List[TokenLogprobs]:
    """Logprobs of ``token_ids[i]`` under row ``i`` of ``logits``, with ``ks[i]`` alternatives.

    Args:
        logits: ``[R, V]`` raw logits (float32; float64 kept).
        token_ids: ``R`` token ids (the sampled or the actual prompt token of each row).
        ks: ``R`` top-k counts (0..V).

    Returns:
        ``R`` :class:`TokenLogprobs`.
    """
    out: List[TokenLogprobs] = []
    n = logits.shape[0]
    if not (n == len(token_ids) == len(ks)):
        raise ValueError(f"token_logprobs: {n} rows, {len(token_ids)} token ids, {len(ks)} k values")
    for lo in range(0, n, _BLOCK):
        hi = min(n, lo + _BLOCK)
        x = logits[lo:hi]
        lp = torch.log_softmax(x if x.dtype == torch.float64 else x.float(), dim=-1)
        tok = torch.as_tensor(list(token_ids[lo:hi]), dtype=torch.int64, device=lp.device).unsqueeze(1)
        chosen = lp.gather(1, tok)
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        chosen_l = chosen.squeeze(1).tolist()
        kmax = max(ks[lo:hi])
        if kmax > 0:
            top = torch.topk(lp, kmax, dim=-1)
            top_v, top_i = top.values.tolist(), top.indices.tolist()
        for j in range(hi - lo):
            k = ks[lo + j]
            ids = top_i[j][:k] if k else []
            vals = top_v[j][:k] if k else []
            out.append(TokenLogprobs(int(token_ids[lo + j]), chosen_l[j], int(ranks[j]), ids, vals))
    return out


class TokenDecoder:
    """``decoded_token`` of :class:`~radixkv.outputs.Logprob`: each token's text on its own
    (``tokenizer.decode([id])``, special tokens kept), memoized per id.

    Args:
        tokenizer: a transformers tokenizer, or None (every text is None).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._memo: Dict[int, Optional[str]] = {}

    def __call__(self, token_id: int) -> Optional[str]:
        s = self._memo.get(token_id)
        if s is None and token_id not in self._memo:
            s = None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._memo[token_id] = s
        return s


def to_position_logprobs(entry: TokenLogprobs, decode: TokenDecoder) -> Dict[int, Logprob]:
    """The output form of one position: the actual token first, then the alternatives by rank
    (``{token id: Logprob}``; a token that is both appears once, first)."""
    d = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
    for r, (t, v) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
        if t not in d:
            d[t] = Logprob(v, r, decode(t))
    return d


@lru_cache(maxsize=1)
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte
    (Radford et al. 2019, ``bytes_to_unicode`` of the GPT-2 tokenizer) -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", None))


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes of one token (OpenAI's logprobs ``bytes``), also for a token that holds
    only part of a multi-byte character (whose ``decoded_token`` is U+FFFD): byte-level BPE
    vocabularies (GPT-2 / SmolLM2 / Llama 3 / Qwen) map each character back to its byte;
    SentencePiece ones read ``<0xHH>`` byte tokens and ``\u2581`` as a space; special tokens
    give their text's UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if token_id in set(getattr(tokenizer, "all_special_ids", ()) or ()):
        return piece.encode("utf-8")
    if _is_byte_level(tokenizer):
        dec = _byte_decoder()
        if all(ch in dec for ch in piece):
            return bytes(dec[ch] for ch in piece)
        return piece.encode("utf-8")
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
