"""Valid text at the Python API's edge.

A Python ``str`` may hold a lone UTF-16 surrogate (a code point in U+D800..U+DFFF: half of a
surrogate pair, e.g. an emoji cut between two ``\\u`` escapes, or bytes decoded with
``errors="surrogateescape"``). It is no Unicode character: the tokenizer refuses such text with a
bare ``TypeError``, and detokenized output never holds one, so a stop string holding one could
never match. Every text the Python API takes (prompts, messages, choices, stop strings) is
checked here first. The HTTP server never sees one: its JSON parser refuses lone surrogates (400
``invalid_json``).
"""

from __future__ import annotations

import re
from typing import Any, List, Optional

from radixkv.errors import RequestError

__all__ = ["check_text", "encode_text"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, param: str, where: Optional[str] = None) -> str:
    """``text`` itself when it is valid Unicode (no lone surrogate).

    Args:
        text: the text to check (a ``str``; anything else is the caller's to refuse).
        param: the field the error names (``RequestError.param``).
        where: how the message names the text (default ``param``), e.g. ``"prompts[1]"``.

    Raises:
        RequestError: (param ``param``) the first lone surrogate, by code point and position.
    """
    if isinstance(text, str) and not text.isascii():
        m = _SURROGATE.search(text)
        if m is not None:
            raise RequestError(
                f"{where or param} holds a lone surrogate U+{ord(m.group()):04X} at position {m.start()}: not valid "
                "Unicode text (join the surrogate pair, or decode the bytes as UTF-8)",
                param,
            )
    return text


def encode_text(tokenizer: Any, text: str, param: str, where: Optional[str] = None) -> List[int]:
    """Token ids of ``text`` (no special tokens added), after :func:`check_text`.

    Raises:
        RequestError: as :func:`check_text`.
    """
    check_text(text, param, where)
    return list(tokenizer.encode(text, add_special_tokens=False))
