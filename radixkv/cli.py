"""The `radixkv` console script: `radixkv replay ...` (the main job), `radixkv serve ...`,
`radixkv explain TRACE` (why prompts miss the prefix cache) and `radixkv plan` (KV capacity)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit code."""
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from radixkv import replay
    from radixkv.obs import cli as obs_cli
    from radixkv.server import cli as server_cli

    replay.add_arguments(sub.add_parser("replay", help="replay ShareGPT conversations, radix cache on vs off"))
    server_cli.add_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    obs_cli.add_explain_arguments(sub.add_parser("explain", help="why a trace's prompts miss the prefix cache"))
    obs_cli.add_plan_arguments(sub.add_parser("plan", help="KV memory a model and its traffic need"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "explain":
        return obs_cli.run_explain(args)
    if args.command == "plan":
        return obs_cli.run_plan(args)
    why = server_cli.tier_flags_error(args)
    if why is not None:
        print(f"radixkv {args.command}: {why}", file=sys.stderr)
        return 2
    if args.command == "replay":
        try:
            return replay.run(args)
        except (ValueError, FileNotFoundError) as e:  # an engine limit, or no such --model
            print(f"radixkv replay: {e}", file=sys.stderr)
            return 2
    why = server_cli.replica_flags_error(args)
    if why is not None:
        print(f"radixkv serve: {why}", file=sys.stderr)
        return 2
    if getattr(args, "replicas", 1) > 1:  # N engines on Ray Serve (the ray extra)
        from radixkv.router.ray import run as run_replicas
        from radixkv.server.auth import KeysFileError

        try:
            keys = server_cli.api_keys_of(args)
            server_cli.check_host(args.host, args.port)  # as one engine: before Ray starts
        except (KeysFileError, ValueError) as exc:
            print(f"radixkv serve: {exc}", file=sys.stderr)
            return 2
        ekw = server_cli.engine_kwargs_from_args(args, keys)
        return run_replicas(args, ekw, server_cli.served_model_name(args), api_keys=keys)
    try:
        return server_cli.run(args)
    except (ValueError, FileNotFoundError) as e:  # a refused setting at start, or no such --model
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
