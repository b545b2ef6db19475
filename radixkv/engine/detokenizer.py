"""Incremental detokenization with stop strings.

Decoding the whole output again at every step is quadratic and re-decoding a single token loses
the leading-space and multi-byte context, so (as Hugging Face's ``TextStreamer`` and vLLM's
incremental detokenizer do) text is produced from a short window: the tokens since the last
emitted boundary (``prefix_offset``) are decoded, and only what extends the previously decoded
window is appended. Output that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until
the next token completes it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence


class IncrementalDetokenizer:
    """Text of one sample's output, updated one token at a time.

    Args:
        tokenizer: a transformers tokenizer (``decode``), or None (text stays empty).
        stop: stop strings; the text is cut before the first one that appears (after it with
            ``include_stop``).
        skip_special_tokens: passed to ``decode``.
        include_stop: keep the matched stop string (``SamplingParams.include_stop_str_in_output``).

    Attributes:
        text: the output text so far.
        stopped_by: the stop string found, or None.
    """

    def __init__(
        self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True, include_stop: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip = skip_special_tokens
        self.include_stop = include_stop
        self.text = ""
        self.stopped_by: Optional[str] = None
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def settled_text(self) -> str:
        """``text`` less what a stop string completed later could still cut off: while no stop
        string was found, the last ``len(longest stop) - 1`` characters are held back (vLLM's
        stop buffer; none with ``include_stop``, whose cut never shortens the text). What a
        stream shows, so streamed text only grows (the final output shows ``text``)."""
        if not self.stop or self.include_stop or self.stopped_by is not None:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def update(self, token_ids: List[int], final: bool = False, check_stop: bool = True) -> bool:
        """Account for ``token_ids`` (the whole output so far, one token more than last call).

        Args:
            token_ids: all output token ids.
            final: flush text held back for an incomplete character.
            check_stop: look for stop strings ending in the new text (False for the first
                ``min_tokens`` tokens: a stop string that completes in them is not a stop).

        Returns:
            True when a stop string was found (``text`` is then truncated before it, or after
            it with ``include_stop``).
        """
        if self.tokenizer is None or self.stopped_by is not None:
            return self.stopped_by is not None
        before = self._decode(token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(token_ids[self._prefix_offset :])
        if len(window) <= len(before) or (window.endswith("\ufffd") and not final):
            return False
        delta = window[len(before) :]
        self.text += delta
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        if self.stop and check_stop:
            # a stop string that ends in the new text (it may begin in the text before it)
            base = len(self.text) - len(delta)
            hits = [(self.text.find(s, max(0, base - len(s) + 1)), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                self.stopped_by = s
                return True
        return False
