"""From an OpenAI request body to the engine's terms: the model check and ``SamplingParams``."""

from __future__ import annotations

from typing import Any

from radixkv.errors import RequestError
from radixkv.sampling_params import SamplingParams
from radixkv.server.engine_client import request_error_to_api
from radixkv.server.openai.protocol import APIError

__all__ = ["ModelNames", "sampling_params"]


class ModelNames:
    """The ``model`` names this server answers to.

    Args:
        served_model_name: the name ``/v1/models`` lists.
        aliases: further accepted names (e.g. the ``--model`` argument).
    """

    def __init__(self, served_model_name: str, aliases=()) -> None:
        self.served = served_model_name
        self.accepted = {served_model_name, *aliases}

    def check(self, model: str) -> None:
        """Raises :class:`APIError` (404-style ``model_not_found``, HTTP 400) for another name."""
        if model not in self.accepted:
            raise APIError(
                f"model {model!r} does not exist; this server serves {self.served!r}",
                "model",
                code="model_not_found",
            )


def sampling_params(req: Any, prompt_lens: list[int], ctx: int, default_max: int | None, param: str) -> SamplingParams:
    """The request's ``SamplingParams``, with ``max_tokens`` checked against the context ``ctx``
    (unset: the rest of the context, capped at ``default_max``).

    Raises:
        APIError: a prompt or ``max_tokens`` beyond the context (``context_length_exceeded``),
            or a value ``SamplingParams`` refuses (naming the field).
    """
    longest = max(prompt_lens)
    if longest >= ctx:
        raise APIError(
            f"{param} has {longest} tokens; this model's context is {ctx} tokens "
            f"(at most {ctx - 1} prompt tokens, leaving room for one generated token)",
            param,
            code="context_length_exceeded",
        )
    room = ctx - longest
    if req.max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif req.max_tokens > room:
        raise APIError(
            f"max_tokens={req.max_tokens} plus the {longest} prompt tokens exceeds this model's "
            f"context of {ctx} tokens (at most {room} new tokens)",
            "max_tokens",
            code="context_length_exceeded",
        )
    else:
        max_tokens = req.max_tokens
    kwargs: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        n=req.n or 1,
        seed=req.seed,
        stop=req.stop_list,
        ignore_eos=bool(req.ignore_eos),
    )
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    if req.min_p is not None:
        kwargs["min_p"] = req.min_p
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stop_token_ids)
    try:
        return SamplingParams(**kwargs)
    except RequestError as exc:
        raise request_error_to_api(exc) from exc
