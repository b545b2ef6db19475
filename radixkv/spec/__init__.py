"""Speculative decoding from what the engine already knows (docs/speculative.md): draft tokens
from the radix tree, prompt lookup, siblings, a cross-request suffix index and the grammar,
verified in one forward by the engine (:mod:`radixkv.engine.verify`).

Modules: :mod:`~radixkv.spec.config` (``speculative_config``; a leaf), :mod:`~radixkv.spec.drafter`
(the sources and the per-request draft length), :mod:`~radixkv.spec.ngram` (prompt lookup),
:mod:`~radixkv.spec.suffix` (the cross-request index), :mod:`~radixkv.spec.adaptive` (the cost
model) and :mod:`~radixkv.spec.grammar_drafts` (structured outputs). This package reads requests
by attribute and never imports the engine.
"""

from radixkv.spec.config import MAX_SPECULATIVE_TOKENS, SPEC_METHODS, SpeculativeConfig, parse_speculative_config

__all__ = ["MAX_SPECULATIVE_TOKENS", "SPEC_METHODS", "SpeculativeConfig", "parse_speculative_config"]
