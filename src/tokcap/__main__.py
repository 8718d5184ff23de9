"""The ``tokcap`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tokcap`` CLI; return the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tokcap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "verify",
        help="verify a manifest against staged records (forwards to `tokcap-core verify`)",
        add_help=False,
    )
    if args and args[0] == "verify":
        from tokcap_core._cli import main as core_main

        return int(core_main(args) or 0)
    parser.parse_args(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
