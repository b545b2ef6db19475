"""ShareGPT token ids for the workloads: a thin re-export of :mod:`radixkv.sim.sharegpt`, where
the tokenized set is built once (safely when several worker processes ask at the same time) and
cached under ``$RADIXKV_CACHE_DIR`` (default ``~/.cache/radixkv``)."""

from __future__ import annotations

from radixkv.sim.sharegpt import (  # noqa: F401
    build_token_cache,
    chat_frame,
    clean_turns,
    default_tokens_file,
    ensure_token_cache,
    iter_conversations,
    load_conversations,
)

TOKENS_FILE = default_tokens_file()

if __name__ == "__main__":
    print(build_token_cache())
