"""`radixkv serve`: start the OpenAI-compatible server (FastAPI app under uvicorn).

Example::

    radixkv serve --model smollm2-135m --host 127.0.0.1 --port 30000
    python -m radixkv serve --page-size 16 --max-total-tokens 65536 --prefix-cache radix
    radixkv serve --host-cache-bytes 4GiB --disk-cache-dir /var/cache/radixkv   # KV tiers
    radixkv serve --replicas 2 --remote-cache-url redis://127.0.0.1:6379/0      # a shared tier
    radixkv serve --kv-cache-dtype bf16 --kv-cache-memory-bytes 2GiB
    radixkv serve --api-key "$KEY"            # one admin tenant; or RADIXKV_API_KEY
    radixkv serve --api-keys-file keys.json   # tenants, admins, soft KV quotas (server/auth.py)
    radixkv serve --speculative-config '{"method": "radix", "num_speculative_tokens": 5}'
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from typing import Any, Iterator, Optional

from radixkv.config import ATTENTION_BACKENDS, parse_bytes, parse_memory_bytes
from radixkv.server.app import DEFAULT_SERVED_MODEL_NAME
from radixkv.server.body import DEFAULT_MAX_REQUEST_BYTES
from radixkv.spec import config as spec_config

__all__ = [
    "add_arguments",
    "add_tier_arguments",
    "tier_kwargs_from_args",
    "run",
    "engine_kwargs_from_args",
    "api_keys_of",
    "tier_flags_error",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` flags to ``parser`` (engine options mirror ``LLM(...)``'s keywords)."""
    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model", default="smollm2-135m", help="model name, GGUF file or HF directory (default: %(default)s)"
    )
    g.add_argument(
        "--served-model-name", default=None, type=_non_empty,
        help=f"name clients send as `model` (default: {DEFAULT_SERVED_MODEL_NAME!r} for the default model, else --model)",
    )  # fmt: skip
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    g.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto (default: %(default)s)")
    g.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default: %(default)s)")
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV pool capacity in tokens (default: engine's)")
    g.add_argument(
        "--kv-cache-dtype", default="auto",
        help="K/V storage dtype: auto (the model's dtype), float32, bfloat16, float16, fp8_e4m3, fp8_e5m2 "
        "(aliases fp32, bf16, fp16, half, fp8) (default: %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--kv-cache-memory-bytes", default=None, metavar="BYTES",
        help="KV pool size in bytes, e.g. 2GiB, 512MiB, 1.5GB (instead of --max-total-tokens; default: engine's)",
    )  # fmt: skip
    g.add_argument(
        "--max-running-requests", type=int, default=None, help="running-batch size limit (default: engine's)"
    )
    g.add_argument(
        "--chunked-prefill-size", type=int, default=None, help="prefill token budget per step (default: engine's)"
    )
    g.add_argument(
        "--max-n", type=int, default=None, help="most samples (n) one request may ask for (default: engine's, 128)"
    )
    g.add_argument(
        "--max-queued-requests", type=int, default=1024,
        help="most requests waiting for admission; beyond it a request gets 429 queue_full (default: %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--max-context-len", type=int, default=None,
        help="longest prompt + output in tokens (default: the model's, capped by the pool)",
    )  # fmt: skip
    g.add_argument(
        "--schedule-policy", choices=["lpm", "fcfs"], default="lpm", help="admission order (default: %(default)s)"
    )
    g.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
        help="attention kernels (default: %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--prefix-cache", choices=["radix", "hash", "none"], default=None,
        help="prefix cache: radix tree, hashed blocks, or none (default: radix)",
    )  # fmt: skip
    g.add_argument("--disable-prefix-caching", action="store_true", help="same as --prefix-cache none")
    g.add_argument(
        "--speculative-config", type=spec_config.cli_arg, default=None, metavar="JSON", help=spec_config.CLI_HELP
    )
    g.add_argument(
        "--radix-eviction-policy", choices=["lru", "lfu", "gdf", "reuse-odds"], default="lru",
        help="which radix-tree leaf is evicted first, page by page from its tail (default: %(default)s)",
    )  # fmt: skip
    add_tier_arguments(parser)
    _add_serving_arguments(parser)


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags of replicas, HTTP, and API keys and tenants."""
    r = parser.add_argument_group("replicas (Ray Serve, extra radixkv[ray]; docs/routing.md)")
    r.add_argument(
        "--replicas",
        type=_at_least(int, 1),
        default=1,
        help="engine replicas; > 1 serves them on Ray Serve (default: 1)",
    )
    r.add_argument(
        "--router-policy", default=None,
        choices=["cache_events", "approx_tree", "session", "least_load", "round_robin"],
        help="routing policy across replicas (default: cache_events)",
    )  # fmt: skip
    r.add_argument(
        "--replica-cpus", type=_at_least(float, 0), default=None, help="Ray logical CPUs per replica (default: 0.5)"
    )
    r.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting a local one")
    h = parser.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    h.add_argument("--port", type=_port, default=30000, help="port, 1 to 65535 (default: %(default)s)")
    h.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn and radixkv log level (default: %(default)s)",
    )  # fmt: skip
    h.add_argument(
        "--shutdown-timeout", type=_at_least(float, 0), default=None, metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long the requests in flight may run before they are aborted (their "
        "responses end with finish_reason \"abort\"; vLLM's flag; 0: at once; default: no limit)",
    )  # fmt: skip
    h.add_argument(
        "--log-requests", default=None, metavar="FILE",
        help="append every completions / chat request body to FILE (JSONL: the trace `radixkv explain` reads)",
    )  # fmt: skip
    h.add_argument(
        "--max-request-bytes", type=_request_bytes, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
        help="largest request body read (an int or 32MiB, 1MB, ...); a larger one is a 413 (default: 32MiB)",
    )  # fmt: skip
    a = parser.add_argument_group("API keys and tenants (docs/security.md)")
    a.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (one tenant, an admin); "
        "default: the RADIXKV_API_KEY environment variable",
    )  # fmt: skip
    a.add_argument(
        "--api-keys-file", default=None, metavar="FILE",
        help='JSON {"<key>": {"tenant": NAME, "admin": false, "kv_quota_tokens": N}, ...}: a cache namespace '
        "per tenant, admin-only stats and flushes, soft KV quotas",
    )  # fmt: skip
    a.add_argument(
        "--max-queued-requests-per-tenant", type=int, default=None,
        help="most requests of one tenant (API key's tenant) waiting for admission; beyond it that tenant's "
        "request gets 429 queue_full while other tenants are still queued (default: no per-tenant bound)",
    )  # fmt: skip


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV tier flags (docs/tiers.md), shared by ``serve`` and ``replay``: the
    :class:`~radixkv.config.EngineConfig` fields of the same names."""
    t = parser.add_argument_group("KV tiers below the pool (docs/tiers.md)")
    t.add_argument(
        "--host-cache-bytes", type=_bytes, default=None, metavar="BYTES",
        help="host-RAM tier budget, e.g. 4GiB or 500MB (default: none)",
    )  # fmt: skip
    t.add_argument(
        "--disk-cache-dir", default=None, metavar="DIR",
        help="disk tier directory, kept across restarts and shareable by processes (default: none)",
    )  # fmt: skip
    t.add_argument(
        "--disk-cache-bytes", type=_bytes, default=None, metavar="BYTES", help="disk tier budget (default: 8GiB)"
    )
    t.add_argument(
        "--remote-cache-url", default=None, metavar="URL",
        help="shared Redis / Valkey tier: redis://[user:pass@]host:port/db or rediss://... (default: none)",
    )  # fmt: skip
    t.add_argument(
        "--kv-tier-write-policy", default=None, metavar="POLICY",
        help="write_through or write_back for every tier, or per tier as host=write_back,disk=write_through "
        "(default: write_back for host, write_through for disk and remote)",
    )  # fmt: skip
    t.add_argument(
        "--first-token-preemption", action="store_true", default=None,
        help="under memory pressure, retract running requests (their K/V kept by the tiers) so that waiting "
        "requests get their first token sooner (EngineConfig.first_token_preemption; default off)",
    )  # fmt: skip


def _at_least(kind: type, low: float) -> Any:
    """An argparse ``type``: ``kind(text)``, refused below ``low`` (argparse names the flag)."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not v >= low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return v

    return parse


def _port(text: str) -> int:
    """``--port``: a TCP port, 1 to 65535 (the socket layer would wrap a larger one silently)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 65535, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 65535, got {text}")
    return v


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a non-empty name")
    return text


def _bytes(text: str) -> int:
    """``--*-cache-bytes``: :func:`radixkv.config.parse_bytes`."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _request_bytes(text: str) -> int:
    """``--max-request-bytes``: :func:`radixkv.config.parse_memory_bytes` (at least 1 byte)."""
    try:
        return parse_memory_bytes(text, "--max-request-bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _write_policy(text: str) -> Any:
    """``--kv-tier-write-policy``: one policy, or ``tier=policy`` pairs separated by commas."""
    from radixkv.config import parse_write_policy

    return parse_write_policy(text)


def tier_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The KV tier fields of ``EngineConfig`` from parsed :func:`add_tier_arguments` flags (those
    left unset are omitted)."""
    kw: dict[str, Any] = {}
    for name in ("host_cache_bytes", "disk_cache_dir", "disk_cache_bytes", "remote_cache_url"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if getattr(args, "kv_tier_write_policy", None) is not None:
        kw["kv_tier_write_policy"] = _write_policy(args.kv_tier_write_policy)
    if getattr(args, "first_token_preemption", None):
        kw["first_token_preemption"] = True
    return kw


def tier_flags_error(args: argparse.Namespace) -> Optional[str]:
    """Why the tier flags cannot be used as given (None: they can): ``--disk-cache-bytes`` without
    ``--disk-cache-dir``, or ``--kv-tier-write-policy`` without any tier (each would do nothing)."""
    if getattr(args, "disk_cache_bytes", None) is not None and getattr(args, "disk_cache_dir", None) is None:
        return "--disk-cache-bytes applies only with --disk-cache-dir (there is no disk tier to size)"
    tiers = args.host_cache_bytes or args.disk_cache_dir is not None or args.remote_cache_url is not None
    if getattr(args, "kv_tier_write_policy", None) is not None and not tiers:
        return "--kv-tier-write-policy needs a KV tier (--host-cache-bytes, --disk-cache-dir or --remote-cache-url)"
    if getattr(args, "first_token_preemption", None) and not tiers:
        return "--first-token-preemption needs a KV tier (--host-cache-bytes, --disk-cache-dir or --remote-cache-url)"
    return None


def check_host(host: str, port: int) -> None:
    """Raise ValueError naming ``--host`` when it does not resolve (checked before the model loads;
    uvicorn would only fail after). Binding is left to uvicorn."""
    import socket

    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it: {exc.strerror}") from None


def listen_error(host: str, port: int) -> Optional[str]:
    """Why nothing can listen on ``host:port`` now (another process listens there, an address
    not of this machine), or None: bound and closed at once, with ``SO_REUSEADDR`` as uvicorn
    and Ray Serve's proxy bind (a port in TIME_WAIT is free)."""
    import socket

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = found[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as exc:
        return f"--port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def check_log_file(path: Optional[str]) -> None:
    """Raise ValueError naming ``--log-requests`` when ``path`` cannot be appended to (checked at
    start, before the model loads, by opening it as the request log does: its folder created, a
    new file 0600)."""
    if path is None:
        return
    from radixkv.obs.trace import TraceWriter

    try:
        TraceWriter(path).close()
    except OSError as exc:
        raise ValueError(f"--log-requests {path}: cannot append to it: {exc.strerror or exc}") from None


def api_keys_of(args: argparse.Namespace) -> Any:
    """The :class:`~radixkv.server.auth.APIKeys` of ``--api-key`` / ``RADIXKV_API_KEY`` /
    ``--api-keys-file`` (None: no keys).

    Raises:
        KeysFileError: both given, an empty key, or a malformed keys file (naming the problem).
    """
    from radixkv.server.auth import keys_from_args

    return keys_from_args(getattr(args, "api_key", None), getattr(args, "api_keys_file", None))


def engine_kwargs_from_args(args: argparse.Namespace, api_keys: Optional[Any] = None) -> dict[str, Any]:
    """The :class:`~radixkv.config.EngineConfig` fields for parsed `serve` flags (options left
    unset are omitted, so the engine's own defaults apply); ``api_keys``' quotas become
    ``tenant_kv_quota_tokens``."""
    kw: dict[str, Any] = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        schedule_policy=args.schedule_policy,
        prefix_cache="none" if args.disable_prefix_caching else (args.prefix_cache or "radix"),
        eviction_policy=args.radix_eviction_policy,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    for name in (
        "max_total_tokens",
        "kv_cache_memory_bytes",
        "max_running_requests",
        "chunked_prefill_size",
        "max_n",
        "max_queued_requests",
        "max_queued_requests_per_tenant",
        "max_context_len",
    ):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    kw.update(tier_kwargs_from_args(args))
    if getattr(args, "speculative_config", None) is not None:
        kw["speculative_config"] = args.speculative_config
    if api_keys is not None and api_keys.quotas():
        kw["tenant_kv_quota_tokens"] = api_keys.quotas()
    return kw


def served_model_name(args: argparse.Namespace) -> str:
    """The model name the server answers to (``--served-model-name``, else the model's)."""
    return args.served_model_name or (DEFAULT_SERVED_MODEL_NAME if args.model == "smollm2-135m" else args.model)


REPLICA_FLAGS = dict(router_policy=("--router-policy", "cache_events"), replica_cpus=("--replica-cpus", 0.5))
REPLICA_FLAGS["ray_address"] = ("--ray-address", None)
"""The flags that only mean something with ``--replicas N > 1``: ``dest -> (flag, default)``."""


def replica_flags_error(args: Any) -> Optional[str]:
    """Why ``args`` cannot be served as given: a replicas-only flag set with ``--replicas 1``
    (it would do nothing), a one-engine flag (``--log-requests``, ``--shutdown-timeout``) with
    ``--replicas N > 1``, or ``--disable-prefix-caching`` beside ``--prefix-cache radix|hash``
    (one of them would be ignored). Otherwise None, with the unset replicas flags given their
    defaults."""
    if getattr(args, "replicas", 1) <= 1:
        for dest, (flag, _) in REPLICA_FLAGS.items():
            if getattr(args, dest, None) is not None:
                return f"{flag} applies only with --replicas N > 1 (one engine has nothing to route or place)"
    else:
        for dest in ("log_requests", "shutdown_timeout"):
            if getattr(args, dest, None) is not None:
                return f"--{dest.replace('_', '-')} is not supported with --replicas > 1"
    if getattr(args, "disable_prefix_caching", False) and getattr(args, "prefix_cache", None) not in (None, "none"):
        return f"--disable-prefix-caching contradicts --prefix-cache {args.prefix_cache}: give one of them"
    for dest, (_, default) in REPLICA_FLAGS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    return None


def _listen_error_before_loading(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Optional[str]:
    """Why nothing can listen on ``--host:--port`` (:func:`listen_error`), checked once the engine's
    settings and the model's path are (so that their own errors come first, also while the port
    is taken), and before the model loads.

    Raises:
        ValueError: a refused engine setting, naming it. FileNotFoundError: no such ``--model``.
    """
    from radixkv.config import EngineConfig
    from radixkv.models.loader import resolve_hf_dir

    EngineConfig(**engine_kwargs).resolve()
    resolve_hf_dir(engine_kwargs["model"])
    return listen_error(args.host, args.port)


def run(args: argparse.Namespace) -> int:
    """Load one engine, then serve until interrupted; returns the exit code. (``--replicas N > 1``
    is dispatched by the ``radixkv`` console script to :func:`radixkv.router.ray.run`.)"""
    if getattr(args, "replicas", 1) > 1:
        raise ValueError("replicas: server.cli.run serves one engine; radixkv.cli dispatches --replicas > 1")
    served = served_model_name(args)
    from radixkv.server.auth import KeysFileError

    try:
        keys = api_keys_of(args)
    except KeysFileError as exc:
        print(f"radixkv serve: {exc}", file=sys.stderr)
        return 2
    check_host(args.host, args.port)
    check_log_file(args.log_requests)
    engine_kwargs = engine_kwargs_from_args(args, keys)
    bad = _listen_error_before_loading(args, engine_kwargs)
    if bad is not None:  # uvicorn failed to bind only after the model load (exit 3); as the replicas' check
        print(f"radixkv serve: {bad}", file=sys.stderr)
        return 1
    import uvicorn

    from radixkv.async_llm import AsyncLLM
    from radixkv.server.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = AsyncLLM(**engine_kwargs)
    app = create_app(
        llm,
        served_model_name=served,
        model_aliases=(args.model,),
        shutdown_engine=True,
        log_requests=args.log_requests,
        api_keys=keys,
        max_request_bytes=args.max_request_bytes,
    )
    auth = f", API keys of {len(keys.tenants())} tenant(s)" if keys is not None else ""
    print(f"radixkv: serving {served!r} at http://{args.host}:{args.port}/v1{auth}", flush=True)
    from radixkv.server.draining import DrainingServer

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    server = DrainingServer(config, args.shutdown_timeout, lambda: app.state.backend.abort_requests(None))
    try:
        with _sigterm_ends_serving():
            server.run()
    except KeyboardInterrupt:
        pass  # Ctrl-C (re-raised by uvicorn after its graceful shutdown), as uvicorn.run takes it
    finally:
        llm.shutdown()
    return 0 if server.started else 3  # 3: uvicorn's own status when it could not start


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is: it ends ``radixkv serve`` as Ctrl-C does."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_ends_serving() -> Iterator[None]:
    """SIGTERM ends serving with exit status 0, as Ctrl-C and ``serve --replicas`` do. uvicorn
    shuts down gracefully on it (the requests in flight end, then the app's lifespan closes the
    engine), then re-raises it under the handler found at start: the default one killed the
    process (status -15). Here that handler raises :class:`_Terminated`, which ends the block
    (also before uvicorn took the signal over). Main thread only (elsewhere signals cannot be
    handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
