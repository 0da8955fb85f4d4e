"""The ``turnpoint`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


def _version(_: argparse.Namespace) -> int:
    from turnpoint import PROTOCOL_VERSION, __version__

    print(f"turnpoint {__version__} ({PROTOCOL_VERSION})")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from turnpoint.trainer._inspect import inspect_command

    return inspect_command(args.root, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnpoint",
        description="Checkpoint control protocol for agentic-RL trainers and Gym servers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the package and protocol version")
    version.set_defaults(handler=_version)
    inspect = sub.add_parser(
        "inspect",
        help="list published snapshots under a root and verify every digest",
        description="List the published snapshots under ROOT, newest first, and verify "
        "every digest they name. Exits 1 on any mismatch.",
    )
    inspect.add_argument("root", metavar="ROOT", help="the snapshot root directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(handler=_inspect)
    from turnpoint.server._serve import add_serve_parser

    add_serve_parser(sub)
    from turnpoint.server._bench import add_bench_parser

    add_bench_parser(sub)
    from turnpoint.server.bench._cli import add_bench_parser as add_system_bench_parser

    add_system_bench_parser(sub)
    from turnpoint.server.demo import add_demo_parser

    add_demo_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
