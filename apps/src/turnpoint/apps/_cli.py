"""The ``turnpoint`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _version(_: argparse.Namespace) -> int:
    from importlib.metadata import version

    from turnpoint.protocol import PROTOCOL_VERSION

    print(f"turnpoint {version('turnpoint-core')} ({PROTOCOL_VERSION})")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from turnpoint.apps._inspect import inspect_command

    return inspect_command(args.root, as_json=args.json, restore_from=args.restore_from)


# (module, function adding the subcommand(s), the extra that brings what it imports)
_APPLICATIONS = (
    ("turnpoint.apps._serve", "add_serve_parser", "demo"),
    ("turnpoint.apps.bench._participant_bench", "add_bench_parser", "demo"),
    ("turnpoint.apps.bench._cli", "add_bench_parser", "demo"),
    ("turnpoint.apps.bench._storage_bench", "add_bench_parser", "demo"),
    ("turnpoint.apps.bench._heal_bench", "add_bench_parser", "demo"),
    ("turnpoint.apps.demo", "add_demo_parser", "demo"),
    ("turnpoint.apps.conformance", "add_conformance_parser", "demo"),
)
# The subcommands each of them adds, for the message when its extra is missing.
_COMMANDS = {
    "turnpoint.apps._serve": ("serve",),
    "turnpoint.apps.bench._participant_bench": ("bench-participant",),
    "turnpoint.apps.bench._cli": ("bench",),
    "turnpoint.apps.bench._storage_bench": ("bench-storage",),
    "turnpoint.apps.bench._heal_bench": ("bench-heal",),
    "turnpoint.apps.demo": ("demo",),
    "turnpoint.apps.conformance": ("conformance",),
}


def _add_application(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    module_name: str,
    function: str,
    extra: str,
) -> None:
    """Register an application's subcommands; without its extra, a stub that says so.

    The library installs without the applications' dependencies (torch, rich,
    matplotlib, aiohttp), so ``turnpoint inspect`` works on a light install and
    ``turnpoint demo`` there explains what to install instead of a traceback.
    """
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or "a dependency"
        for command in _COMMANDS[module_name]:
            stub = sub.add_parser(command, help=f"(needs: pip install 'turnpoint[{extra}]')")
            stub.set_defaults(handler=_missing(command, missing, extra))
        return
    getattr(module, function)(sub)


def _missing(command: str, module: str, extra: str) -> Handler:
    def handler(_: argparse.Namespace) -> int:
        print(
            f"turnpoint {command}: needs {module!r}, which this install lacks; "
            f"install it with: pip install 'turnpoint[{extra}]'",
            file=sys.stderr,
        )
        return 2

    return handler


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
    inspect.add_argument(
        "root",
        metavar="ROOT",
        help="the snapshot root: a directory or a storage URL (s3://bucket/prefix)",
    )
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument(
        "--restore-from",
        default="latest",
        metavar="CHOICE",
        help=(
            "list the restore candidates in the order a restore by CHOICE tries them: "
            "latest, snapshot:<id>, best:<metric> or best:-<metric> (docs/spec.md 7.14)"
        ),
    )
    inspect.set_defaults(handler=_inspect)
    for register in _APPLICATIONS:
        _add_application(sub, *register)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # What was asked, for a command that runs itself again (`serve --workers N`).
    args.argv = list(sys.argv[1:] if argv is None else argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
