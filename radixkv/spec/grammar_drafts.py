"""Drafts under a structured output: cut where the grammar refuses, extended by what it forces.

With a grammar active (:class:`~radixkv.sampling.grammar.GrammarState`), a draft token the
grammar does not allow can never be accepted (the mask removes it before the draw), so the draft
is cut before it; and where the grammar allows exactly one continuation (JSON keys, quotes,
commas, braces), those tokens are drafted (jump-forward decoding, as SGLang's; xgrammar's
``find_jump_forward_tokens``), so they cost no forward of their own. The matcher walks the draft
and is rolled back to where it was: nothing changes its state but the tokens the sampler takes.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

__all__ = ["grammar_draft"]

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
    out: List[int] = []
    if matcher.is_terminated():
        return out
    try:
        for t in draft[:k]:
            if not matcher.accept_token(int(t)):
                break
            out.append(int(t))
            if matcher.is_terminated():
                return out
        for _ in range(_JUMPS if jump_forward else 0):
            if len(out) >= k or matcher.is_terminated():
                break
            forced = _forced(matcher, encode)
            n = len(out)
            for t in forced[: k - len(out)]:
                if not matcher.accept_token(int(t)):
                    break
                out.append(int(t))
            if len(out) == n:
                break
    finally:
        if out:
            matcher.rollback(len(out))
    return out


def _forced(matcher: Any, encode: Optional[Callable[[str], List[int]]]) -> List[int]:
    """The tokens of the text ``matcher`` forces next (see :func:`grammar_draft`)."""
    if encode is not None:
        text = matcher.find_jump_forward_string()
        if text:
            return list(encode(text))
    return list(matcher.find_jump_forward_tokens())
