"""Drafts under a structured output: cut where the grammar refuses, extended by what it forces.

With a grammar active (:class:`~radixkv.sampling.grammar.GrammarState`), a draft token the
grammar does not allow can never be accepted (the mask removes it before the draw), so the draft
is cut before it; and where the grammar allows exactly one continuation (JSON keys, quotes,
commas, braces), those tokens are drafted (jump-forward decoding, as SGLang's; xgrammar's
``find_jump_forward_tokens``), so they cost no forward of their own. The matcher walks the draft
and is rolled back to where it was: nothing changes its state but the tokens the sampler takes.
"""

from __future__ import annotations

from typing import Any, List, Sequence

__all__ = ["grammar_draft"]

_JUMPS = 4  # forced spans appended per draft (each after the tokens before it)


def grammar_draft(matcher: Any, draft: Sequence[int], k: int, jump_forward: bool) -> List[int]:
    """The longest prefix of ``draft`` (at most ``k`` tokens) that ``matcher`` (an
    ``xgrammar.GrammarMatcher``) accepts, then, with ``jump_forward`` and room left, the tokens
    the grammar forces after it. ``matcher`` is left in the state it had."""
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
            forced = matcher.find_jump_forward_tokens()
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
