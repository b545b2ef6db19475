"""Branching programs in process: sessions, forks and select, over :class:`~radixkv.llm.LLM`
(:class:`Session`) and :class:`~radixkv.async_llm.AsyncLLM` (:class:`AsyncSession`).

In the spirit of SGLang's frontend primitives (``fork``, ``gen``, ``select``; Zheng et al.,
"SGLang: Efficient Execution of Structured Language Model Programs", 2024) and its sessions,
without HTTP:

* A **session** is a context of token ids that grows with each call: the prompt of a turn is the
  context so far (its previous prompt + the model's reply, token for token) + the new text, so
  each turn computes only its new tokens. Between calls the session's KV stays **pinned** in the
  engine's KV manager (one soft pin with one reference per holder,
  :meth:`~radixkv.engine.kv_manager.KVManager.pin_prefix`), bounded by
  ``EngineConfig.max_pinned_tokens`` and ``pin_idle_timeout``: past them the least recently used
  session is unpinned (its tokens become evictable, not freed; its next turn recomputes what was
  evicted). ``close()`` (or leaving a ``with`` block, also by an exception) unpins.
* ``session.fork(n)``: ``n`` child sessions holding references on the parent's pin, so they
  share its KV with no recomputation; each then runs its own prompts, seeds and constraints.
  ``n`` is bounded like ``SamplingParams.n`` (``EngineConfig.max_n``).
  ``forks.generate(...)`` / ``forks.chat(...)`` run the children's turns as one batch (their
  common context is computed once even when it is not cached yet: in-batch prefix sharing).
* ``select(prompt, choices)``: the log-likelihood of each choice given the prompt, every choice
  submitted in the same engine step (the prompt is computed once, by the first choice's row, and
  the others share it in that forward), scored from prompt logprobs. Reports each choice's sum and
  token-length-normalized logprob (SGLang's ``select`` with ``token_length_normalized``) and the
  chosen index.

A session made from chat messages continues the conversation with the model's chat template:
``chat(content)`` appends exactly the text the template puts between the model's reply and the
assistant's next turn (the reply's end-of-turn marker is not repeated when the model generated it).
Token ids are the tokenizer's on that text; the context is never re-tokenized.

Without a prefix cache (``prefix_cache="none"``) nothing is kept between calls: sessions and
forks work, but every turn recomputes its context and nothing is pinned.

The package: :mod:`~radixkv.branching.core` writes each call once, as a program of engine
effects (its prompt, its requests, its pin moves); :mod:`~radixkv.branching.driver` runs a
program on an ``LLM`` (:func:`drive`) or an ``AsyncLLM`` (:func:`drive_async`) through their
public methods; :mod:`~radixkv.branching.sessions` binds the core's classes to a driver;
:mod:`~radixkv.branching.prompts` checks what the calls take; :mod:`~radixkv.branching.scoring`
scores ``select``; :mod:`~radixkv.branching.chat` continues a chat token for token.
"""

from radixkv.branching.chat import continue_chat, reply_stop_text
from radixkv.branching.core import select_program
from radixkv.branching.driver import drive, drive_async
from radixkv.branching.prompts import Prompt
from radixkv.branching.scoring import ChoiceScore, SelectResult, score_choices, select_params
from radixkv.branching.sessions import AsyncForks, AsyncSession, Forks, Session

__all__ = [
    "Session",
    "AsyncSession",
    "Forks",
    "AsyncForks",
    "SelectResult",
    "ChoiceScore",
    "Prompt",
    "continue_chat",
    "reply_stop_text",
    "select_program",
    "select_params",
    "score_choices",
    "drive",
    "drive_async",
]
