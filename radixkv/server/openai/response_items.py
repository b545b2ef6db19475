"""``GET /v1/responses/{id}/input_items``: the items a stored Response was generated from.

A Response's input items are what its model saw as the conversation, oldest first: with a
``previous_response_id``, the previous Response's own input items and then its output items,
followed by the new ``input`` (OpenAI lists a chained Response's earlier items too; its
``instructions`` are not an item). Each item is in the form the openai SDK's ``ResponseItem``
parses: a message carries an ``id`` (``msg_...``; a client's own ``id`` is kept), its
``content`` as a list of parts (``input_text`` for user / system / developer, ``output_text``
for assistant) and ``status: "completed"``; ``function_call`` (``fc_...``) and
``function_call_output`` (``fco_...``) items likewise.

:func:`page` cuts the list as OpenAI's cursor pagination does: ``order`` (``"desc"``, the
default, newest first, or ``"asc"``), ``after`` (an item id: the items after it in that order),
``limit`` (1 to 100, default 20); the page says ``first_id``, ``last_id`` and ``has_more``.
"""

from __future__ import annotations

import uuid
from typing import Any, Mapping, Optional, Union

from radixkv.server.openai.protocol import APIError

__all__ = ["input_items", "page"]

_PARAMS = ("after", "limit", "order", "include")
_PART_TYPE = {"assistant": "output_text"}  # every other role's text parts are input_text


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _parts(content: Any, role: str) -> list[dict]:
    """``content`` (a string or text parts, as :func:`input_messages` accepted it) as parts."""
    kind = _PART_TYPE.get(role, "input_text")
    if isinstance(content, str):
        content = [{"type": kind, "text": content}]
    parts = [dict(p) for p in content]
    for p in parts:
        if p.get("type") == "output_text":
            p.setdefault("annotations", [])
    return parts


def _item(item: Union[str, dict]) -> dict:
    """One input item in the listed form (a fresh id where the client gave none)."""
    if isinstance(item, str):
        item = {"type": "message", "role": "user", "content": item}
    kind = item.get("type", "message")
    out = {k: v for k, v in item.items() if k in ("call_id", "name", "arguments", "output")}
    if kind == "message":
        out = {"role": item["role"], "content": _parts(item["content"], item["role"])}
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
    return {"id": item.get("id") or _new_id(prefix), "type": kind, **out, "status": "completed"}


def input_items(input: Union[str, list], previous: Optional[tuple[list, list]] = None) -> list[dict]:
    """The input items, oldest first, of a Response made from ``input`` (already checked by
    :func:`~radixkv.server.openai.responses_protocol.input_messages`) after ``previous``: the
    previous Response's (input items, output items), or None."""
    items = [_item(input)] if isinstance(input, str) else [_item(it) for it in input]
    if previous is None:
        return items
    earlier, output = previous
    return list(earlier) + [dict(it) for it in output] + items


def _limit(raw: Optional[str]) -> int:
    try:
        limit = int(raw) if raw is not None else 20
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(f"limit must be an integer from 1 to 100, got {raw!r}", "limit")
    return limit


def page(items: list[dict], query: Mapping[str, str]) -> dict:
    """One page of ``items`` (oldest first) for the query parameters ``query``.

    Raises:
        APIError: 400 naming the parameter: an unknown one, ``order`` not asc / desc, ``limit``
            out of 1..100, ``after`` not an item of this Response, or any ``include`` (nothing
            it names exists here: text only, no logprobs kept).
    """
    for key in query:
        if key not in _PARAMS:
            raise APIError(f"unknown query parameter {key!r} (supported: {', '.join(_PARAMS)})", key)
    if "include" in query:
        raise APIError(f"include is not supported (text-only input items), got {query['include']!r}", "include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(f"order must be 'asc' or 'desc', got {order!r}", "order")
    limit = _limit(query.get("limit"))
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in query:
        ids = [it["id"] for it in ordered]
        if query["after"] not in ids:
            raise APIError(f"after: no input item {query['after']!r} in this response", "after")
        start = ids.index(query["after"]) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
