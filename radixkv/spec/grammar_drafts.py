"""Drafts under a structured output: cut where the grammar refuses, extended by what it forces.

With a grammar active (:class:`~radixkv.sampling.grammar.GrammarState`), a draft token the
grammar does not allow can never be accepted (the mask removes it before the draw), so the draft
is cut before it; and where the grammar allows exactly one continuation (JSON keys, quotes,
commas, braces), those tokens are drafted (jump-forward decoding, as SGLang's; xgrammar's
``find_jump_forward_tokens``), so they cost no forward of their own. The matcher walks the draft
and is rolled back to where it was: nothing changes its state but the tokens the sampler takes.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

__all__ = ["grammar_draft", "grammar_draft_split"]

_JUMPS = 4  # forced spans appended per draft (each after the tokens before it)


def grammar_draft(
    matcher: Any,
    draft: Sequence[int],
    k: int,
    jump_forward: bool,
    encode: Optional[Callable[[str], List[int]]] = None,
) -> List[int]:
    """The longest prefix of ``draft`` (at most ``k`` tokens) that ``matcher`` (an
    ``xgrammar.GrammarMatcher``) accepts, then, with ``jump_forward`` and room left, the tokens
    the grammar forces after it: the forced text as ``encode`` (the tokenizer, no special
    tokens) splits it, else as xgrammar does. ``matcher`` is left in the state it had.

    NOTE: the grammar allows every split of a forced text into tokens, and the model writes the
    one its tokenizer taught it (``desc`` + ``ribes``), not xgrammar's longest-token split
    (``describe`` + ``s``), which it rejects at the first token."""
    return grammar_draft_split(matcher, draft, k, k if jump_forward else 0, k, encode)[0]


def grammar_draft_split(
    matcher: Any,
    draft: Sequence[int],
    k_free: int,
    k_forced: int,
    cap: int,
    encode: Optional[Callable[[str], List[int]]] = None,
) -> Tuple[List[int], int]:
    """``(tokens, n_free)``: the longest prefix of ``draft[:k_free]`` that ``matcher`` accepts
    (its ``n_free`` tokens), then up to ``k_forced`` tokens the grammar forces after it, at most
    ``cap`` tokens in all (:func:`grammar_draft`). The two parts are counted apart because their
    acceptance rates differ: a forced token is refused only when the model splits the forced
    text otherwise. ``matcher`` is left in the state it had."""
    out: List[int] = []
    if matcher.is_terminated():
        return out, 0
    try:
        for t in draft[: min(k_free, cap)]:
            if not matcher.accept_token(int(t)):
                break
            out.append(int(t))
            if matcher.is_terminated():
                return out, len(out)
        n_free = len(out)
        end = min(cap, n_free + k_forced)
        for _ in range(_JUMPS):
            if len(out) >= end or matcher.is_terminated():
                break
            n = len(out)
            for t in _forced(matcher, encode)[: end - n]:
                if not matcher.accept_token(int(t)):
                    break
                out.append(int(t))
            if len(out) == n:
                break
    finally:
        if out:
            matcher.rollback(len(out))
    return out, n_free


def _forced(matcher: Any, encode: Optional[Callable[[str], List[int]]]) -> List[int]:
    """The tokens of the text ``matcher`` forces next (see :func:`grammar_draft`)."""
    if encode is None:
        return list(matcher.find_jump_forward_tokens())
    text = matcher.find_jump_forward_string()  # NOTE: "" inside free text: no second search then
    return list(encode(text)) if text else []
