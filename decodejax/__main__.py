"""Command line: `python -m decodejax selfcheck`."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodejax")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selfcheck", help="recompute the seed fixtures in float64 and print them")
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        from decodejax import _selfcheck

        return _selfcheck.main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
