"""The ``turnpoint conformance`` command: progress on stderr, the table (or one JSON
object) on stdout; exit 1 when a check failed, 2 on a usage error."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from turnpoint.auth import load_token

from ._kit import HttpFace, Workload, WorkloadError
from ._report import CheckResult, render_line, render_table, report_to_json
from ._runner import CHECKS, ConformanceOptions, run_conformance


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def add_conformance_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    names = ", ".join(check.name for check in CHECKS)
    parser = sub.add_parser(
        "conformance",
        help="check a participant against every participant rule of docs/spec.md",
        description=(
            "Act as a trainer's coordinator, over the wire only, and check every "
            "participant rule of the specification, one named check per rule. Uses a "
            "fresh random coordinator id and an epoch above the one the target holds; "
            "the table ends with what the run leaves on the target. Run it against a "
            f"freshly started participant (the restore check needs one). Checks: {names}."
        ),
    )
    parser.add_argument("--target", required=True, type=_address, metavar="HOST:PORT")
    parser.add_argument(
        "--token-file", help="file holding the bearer token (else $TURNPOINT_TOKEN)"
    )
    parser.add_argument(
        "--data-token-file",
        help="file holding the target's data-plane token: the credential-roles check "
        "(docs/spec.md section 10.2) runs with it",
    )
    parser.add_argument(
        "--openai-endpoint",
        metavar="URL",
        help="the OpenAI endpoint in front of the target (http://host:port/v1): the "
        "openai-endpoint check (docs/spec.md sections 12.2-12.5) runs against it",
    )
    parser.add_argument("--openai-key-file", help="file holding that endpoint's API key")
    parser.add_argument(
        "--relay",
        metavar="URL",
        help="an egress relay (http://host:port/v1): the egress-relay check (section 12.8) "
        "runs against it with the harness credential of --relay-key-file",
    )
    parser.add_argument("--relay-key-file", help="file holding a live harness's relay credential")
    parser.add_argument(
        "--relay-fenced-key-file",
        help="file holding the credential of a replaced harness of the same episode",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--workload",
        metavar="FILE",
        help='JSON {"task": {...}, "answer": {...}, "generate": {"prompt_token_ids": [...], '
        '"max_new_tokens": N}, "call": {"tool": NAME, "arguments": {...}}}: what to send on '
        "the data plane; without a task the checks that need an episode are skipped",
    )
    parser.add_argument(
        "--equivalence",
        metavar="FILE",
        help='a workload (as --workload) with "calls": [{"tool": T, "arguments": {...}}, ...]: '
        "the equivalence check replays them from every turn boundary after a restore into "
        "--restore-target and compares every reply and the reward with an uninterrupted run",
    )
    parser.add_argument(
        "--restore-target",
        type=_address,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a freshly started process of the target (its instance name, its snapshot "
        "root) for a check that restores the target's sessions there: the effects check "
        "and the equivalence check each take one of their own (a participant takes one "
        "restore), so repeat it to run both",
    )
    parser.add_argument(
        "--snapshot-root",
        metavar="DIR",
        help="the target's snapshot root (shared with its restore targets): the equivalence "
        "check writes a copy of its snapshot there with truncated session states, which must "
        "install nothing; the sandboxes check reads the exported sandbox handles there and "
        "restores altered copies of them",
    )
    parser.add_argument(
        "--lease",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="the short lease the lease check waits out (default 1)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="deadline of each control call (default 10)",
    )
    parser.add_argument(
        "--episode-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="bound on waiting for an episode or a held request (default 30)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="CHECK",
        help="run only this check (repeatable)",
    )
    parser.set_defaults(handler=conformance_command)


def _face(url: str | None, key_file: str | None, fenced_file: str | None = None) -> HttpFace | None:
    if url is None:
        if key_file or fenced_file:
            raise ValueError("a key file for an HTTP face needs its URL too")
        return None
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// URL, got {url!r}")
    return HttpFace(
        url.rstrip("/"),
        load_token(key_file) if key_file else None,
        load_token(fenced_file) if fenced_file else None,
    )


def conformance_command(args: argparse.Namespace) -> int:
    try:
        if args.workload and args.equivalence:
            raise ValueError("give --workload or --equivalence, not both")
        chosen = args.equivalence or args.workload
        workload = Workload.from_file(chosen) if chosen else Workload()
        if args.equivalence and not workload.calls:
            raise ValueError("the --equivalence workload needs a non-empty 'calls' list")
        options = ConformanceOptions(
            args.target,
            load_token(args.token_file),
            workload=workload,
            lease_s=args.lease,
            call_timeout_s=args.timeout,
            episode_timeout_s=args.episode_timeout,
            only=tuple(args.only),
            restore_targets=tuple(args.restore_target),
            snapshot_root=Path(args.snapshot_root) if args.snapshot_root else None,
            data_token=load_token(args.data_token_file) if args.data_token_file else None,
            openai_endpoint=_face(args.openai_endpoint, args.openai_key_file),
            relay=_face(args.relay, args.relay_key_file, args.relay_fenced_key_file),
        )
        unknown = sorted(set(options.only) - {c.name for c in CHECKS})
        if unknown:
            raise ValueError(f"unknown check {unknown[0]!r}")
    except (ValueError, WorkloadError) as error:
        print(f"turnpoint conformance: {error}", file=sys.stderr)
        return 2

    def progress(result: CheckResult) -> None:
        print(render_line(result), file=sys.stderr, flush=True)

    print(f"turnpoint conformance: checking {args.target}", file=sys.stderr, flush=True)
    report = asyncio.run(run_conformance(options, progress))
    print(report_to_json(report) if args.json else render_table(report))
    return report.exit_code()
