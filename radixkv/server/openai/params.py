"""From an OpenAI request body to the engine's terms: the model check, the tool plan and
``SamplingParams`` (sampling fields, penalties, bias, logprobs and at most one structured-output
constraint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from radixkv.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_CALLS_SEPARATOR
from radixkv.errors import RequestError
from radixkv.sampling.grammar import tool_call_structural_tag, tool_calls_or
from radixkv.sampling_params import SamplingParams
from radixkv.server.engine_client import request_error_to_api
from radixkv.server.openai.protocol import APIError, ChatCompletionRequest, check_keys

__all__ = [
    "ModelNames",
    "ToolPlan",
    "constraint_of",
    "constraint_renames",
    "forced_calls",
    "sampling_params",
    "tool_plan",
]


class ModelNames:
    """The ``model`` names this server answers to.

    Args:
        served_model_name: the name ``/v1/models`` lists.
        aliases: further accepted names (e.g. the ``--model`` argument).
    """

    def __init__(self, served_model_name: str, aliases=()) -> None:
        self.served = served_model_name
        self.accepted = {served_model_name, *aliases}

    def check(self, model: str, param: str = "model") -> None:
        """Raises :class:`APIError` for another name: HTTP 404, type ``invalid_request_error``,
        code ``model_not_found``, as OpenAI answers an unknown model (the SDK's
        ``NotFoundError``; vLLM answers 404 too)."""
        if model not in self.accepted:
            raise APIError(
                f"model {model!r} does not exist; this server serves {self.served!r}",
                param,
                status_code=404,
                code="model_not_found",
            )


# ------------------------------------------------------------------------------ tools


@dataclass
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` mean here.

    Attributes:
        tools: the tools rendered into the prompt (OpenAI form; all of them, whatever the choice,
            so the prompt prefix stays the same from turn to turn).
        parse: parse tool calls out of the output (choice ``auto``, ``required``, named).
        structural_tag: the xgrammar structural tag of the calls: ``required``, named and
            allowed_tools ``required`` force them (:func:`forced_calls`); ``auto`` leaves the text
            free but makes every ``<tool_call>`` block a valid call (:func:`auto_calls`).
        choice: ``none`` / ``auto`` / ``required`` / ``named``.
        names: the functions a call may name (``auto`` and ``required``: all of them or the
            allowed_tools subset; named: that one); empty for ``none``.
        parallel: ``parallel_tool_calls`` (default True); False: at most one call is returned
            (:attr:`max_calls`), whatever the output holds.
    """

    tools: list[dict] = field(default_factory=list)
    parse: bool = False
    structural_tag: Optional[dict] = None
    choice: str = "none"
    names: list[str] = field(default_factory=list)
    parallel: bool = True

    @property
    def max_calls(self) -> Optional[int]:
        """The ``max_calls`` of the tool-call parser: 1 under ``parallel_tool_calls: false``
        (OpenAI returns at most one call then; the grammar stops after the first call, but a text
        constraint beside ``auto`` tools, e.g. a ``regex``, can still write a second block: it is
        dropped, as vLLM drops it), else None."""
        return None if self.parallel else 1

    @property
    def forced(self) -> bool:
        """The output must be calls (a text constraint beside them then has no text to shape;
        with ``auto`` and a text constraint the output is calls or text under it)."""
        return self.choice in ("required", "named")

    @property
    def cut(self) -> Optional[list[str]]:
        """The ``cut`` argument of :func:`~radixkv.server.parsers.tool_calls.parse_tool_calls`
        (and :class:`~radixkv.server.parsers.tool_calls.ToolCallStream`): whenever calls are
        parsed, a ``<tool_call>`` block that the end of the output cut off (``max_tokens``, a
        stop string, a stop token) is a call, incomplete (its name, the argument text so far),
        as OpenAI and vLLM report it, whatever the finish reason: the grammar (forced, or
        ``auto``'s triggered tags) makes every block a call, and a stream has already sent its
        name and arguments. None when calls are not parsed."""
        return self.names if self.parse else None


def forced_calls(functions: list[dict], parallel: bool) -> dict:
    """The structural tag of one call (``parallel`` False) or one or more calls to any of
    ``functions``, in the built-in format of :mod:`radixkv.chat_template` (calls back to back:
    after ``</tool_call>`` only the end of the turn or another call is allowed; a separating
    newline would let a small model, whose likeliest token after a tag is a newline, repeat the
    call). Built by :func:`radixkv.sampling.grammar.tool_call_structural_tag`."""
    return tool_call_structural_tag(
        functions,
        parallel=parallel,
        begin=TOOL_CALL_OPEN + "\n",
        end="\n" + TOOL_CALL_CLOSE,
        separator=TOOL_CALLS_SEPARATOR,
    )


def auto_calls(functions: list[dict], parallel: bool) -> dict:
    """The structural tag of ``tool_choice: "auto"``: any text, but once the model writes
    ``<tool_call>`` the block must be a valid call to one of ``functions`` (OpenAI's ``strict``
    function calling, for every function); with ``parallel`` False the turn ends after the first
    call. xgrammar's ``triggered_tags`` over :func:`forced_calls`' tags."""
    tags = forced_calls(functions, parallel)["format"]["tags"]
    fmt = {
        "type": "triggered_tags",
        "triggers": [TOOL_CALL_OPEN],
        "tags": tags,
        "at_least_one": False,
        "stop_after_first": not parallel,
    }
    return {"type": "structural_tag", "format": fmt}


def _named(choice: dict, names: list[str], where: str = "tool_choice") -> str:
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(
            "tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} "
            f"or {{'type': 'allowed_tools', ...}}, got {choice!r}",
            "tool_choice",
        )
    check_keys(choice, ("type", "function"), where, "tool_choice")
    check_keys(fn, ("name",), f"{where}.function", "tool_choice")
    if fn["name"] not in names:
        raise APIError(f"tool_choice names function {fn['name']!r}, which is not in tools {names}", "tool_choice")
    return fn["name"]


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """The :class:`ToolPlan` of a chat request.

    Raises:
        APIError: ``tool_choice`` malformed, naming a function not in ``tools``, or given
            without ``tools`` (a ``parameters`` schema xgrammar cannot compile is refused when the
            engine accepts the request, param ``tools``).
    """
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools if t.function is not None]
    tools = [{"type": "function", "function": f} for f in functions]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(f"tools: function names must be unique, got {names}", "tools")
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    by_name = {f["name"]: f for f in functions}
    if choice == "none":
        return ToolPlan(tools, parse=False, choice="none")
    try:
        if choice is None or choice == "auto":
            return ToolPlan(tools, True, auto_calls(functions, parallel), "auto", names, parallel)
        if choice == "required":
            return ToolPlan(tools, True, forced_calls(functions, parallel), "required", names, parallel)
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            allowed = choice.get("allowed_tools")
            if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
                raise APIError("tool_choice.allowed_tools needs mode 'auto' or 'required' and tools", "tool_choice")
            check_keys(choice, ("type", "allowed_tools"), "tool_choice", "tool_choice")
            check_keys(allowed, ("mode", "tools"), "tool_choice.allowed_tools", "tool_choice")
            at = "tool_choice.allowed_tools.tools"
            subset = [_named(t, names, f"{at}.{i}") for i, t in enumerate(allowed.get("tools") or [])]
            if not subset:
                raise APIError("tool_choice.allowed_tools.tools is empty", "tool_choice")
            fns = [by_name[n] for n in subset]
            if allowed["mode"] == "auto":
                return ToolPlan(tools, True, auto_calls(fns, parallel), "auto", subset, parallel)
            return ToolPlan(tools, True, forced_calls(fns, parallel), "required", subset, parallel)
        if isinstance(choice, dict):
            name = _named(choice, names)
            return ToolPlan(tools, True, forced_calls([by_name[name]], False), "named", [name], parallel)
    except RequestError as exc:
        raise request_error_to_api(exc) from exc
    raise APIError(f"tool_choice must be 'none', 'auto', 'required' or an object, got {choice!r}", "tool_choice")


# ------------------------------------------------------------------------------ constraints


def constraint_of(req: Any, tools: Optional[ToolPlan] = None) -> tuple[Optional[str], dict[str, Any]]:
    """(the request field that set it, ``SamplingParams`` keyword) of the request's one
    structured-output constraint, or ``(None, {})``.

    Raises:
        APIError: more than one constraint (param: the second field).
    """
    found: list[tuple[str, dict[str, Any]]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema", "response_format")
        schema = rf.json_schema.schema_
        found.append(("response_format", {"json_schema": schema if schema is not None else {}}))
    if req.regex is not None:
        found.append(("regex", {"regex": req.regex}))
    if req.ebnf is not None:
        found.append(("ebnf", {"grammar": req.ebnf}))
    if req.guided_json is not None:
        found.append(("guided_json", {"json_schema": req.guided_json}))
    if req.guided_regex is not None:
        found.append(("guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        found.append(("guided_choice", {"choice": list(req.guided_choice)}))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", {"grammar": req.guided_grammar}))
    so = req.structured_outputs
    if so is not None:
        for key, value in (
            ("json_schema", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        ):
            if value is not None:
                found.append(("structured_outputs", {key: value}))
    if len(found) > 1:
        (first, _), (second, _) = found[0], found[1]
        raise APIError(
            f"{second}: at most one structured-output constraint per request, and {first} already sets one",
            second,
        )
    calls = tools.structural_tag if tools is not None else None
    if calls is not None and (tools.forced or not found):
        # NOTE: a forced call leaves no text for a text constraint to shape (OpenAI accepts
        # both and returns the calls); with "auto" the model calls tools or answers in it
        return "tool_choice", {"structural_tag": calls}
    if calls is not None:
        return found[0][0], {"structural_tag": _calls_or(calls, *found[0])}
    return found[0] if found else (None, {})


def _calls_or(calls: dict, source: str, constraint: dict) -> dict:
    """``tool_choice: "auto"``'s calls (their triggered tags, made the whole output) or the text
    constraint ``source`` set (:func:`~radixkv.sampling.grammar.tool_calls_or`)."""
    fmt = calls["format"]
    forced = {"type": "tags_with_separator", "tags": fmt["tags"], "separator": TOOL_CALLS_SEPARATOR}
    forced |= {"at_least_one": True, "stop_after_first": fmt["stop_after_first"]}
    try:
        kind, text = SamplingParams(**constraint).structured_output
        return tool_calls_or({"format": forced}, kind, text)
    except RequestError as exc:
        raise APIError(f"{source}: {exc}", source) from None


# ------------------------------------------------------------------------------ SamplingParams


def sampling_params(
    req: Any,
    prompt_lens: list[int],
    ctx: int,
    default_max: int | None,
    param: str,
    tools: Optional[ToolPlan] = None,
) -> SamplingParams:
    """The request's ``SamplingParams``, with ``max_tokens`` checked against the context ``ctx``
    (unset: the rest of the context, capped at ``default_max``).

    Raises:
        APIError: a prompt or ``max_tokens`` beyond the context (``context_length_exceeded``),
            two constraints, or a value ``SamplingParams`` refuses (naming the field: a bad
            schema, regex or grammar names the request field that carried it).
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
        n=1 if req.n is None else req.n,
        seed=req.seed,
        stop=req.stop_list,
        ignore_eos=bool(req.ignore_eos),
    )
    optional = {
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "allowed_token_ids": req.allowed_token_ids,
        "prompt_logprobs": req.prompt_logprobs,
        "logprob_start_len": req.logprob_start_len,
        "logprobs": req.num_top_logprobs(),
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stop_token_ids)
    if req.logit_bias:
        kwargs["logit_bias"] = dict(req.logit_bias)  # SamplingParams checks the keys and values
    if getattr(req, "echo", False) and req.num_top_logprobs() is not None:
        kwargs["prompt_logprobs"] = max(req.num_top_logprobs(), kwargs.get("prompt_logprobs") or 0)
    source, constraint = constraint_of(req, tools)
    kwargs.update(constraint)
    try:
        return SamplingParams(**kwargs)
    except RequestError as exc:
        raise request_error_to_api(exc, renames=constraint_renames(source)) from exc


CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


def constraint_renames(source: Optional[str]) -> dict[str, str]:
    """Engine constraint fields -> the request field ``source`` that set them (for errors; a
    forced call's structural tag is built from ``tools``, so its faults are the tools')."""
    if source == "tool_choice":
        return {k: "tools" for k in CONSTRAINT_FIELDS}
    # NOTE: only tools make a structural tag; beside a text constraint (auto) that constraint's
    # own faults were named by _calls_or, so what the engine refuses in the tag is the tools'
    return {k: source for k in CONSTRAINT_FIELDS} | {"structural_tag": "tools"} if source else {}
