"""The OpenAI-compatible protocol: request/response bodies (:mod:`.protocol`), the shared
parameter mapping (:mod:`.params`), and one handler per endpoint (:mod:`.completions`,
:mod:`.chat`)."""
