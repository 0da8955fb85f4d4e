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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnpoint",
        description="Checkpoint control protocol for agentic-RL trainers and Gym servers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the package and protocol version")
    version.set_defaults(handler=_version)
    from turnpoint.server._serve import add_serve_parser

    add_serve_parser(sub)
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
