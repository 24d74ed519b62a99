"""``python -m moeserve.server serve|wait-ready|systemd-unit ...``"""

import argparse
import logging
import sys

from moeserve.server.cli import (add_serve_arguments, add_systemd_unit_arguments, add_wait_ready_arguments,
                                 run_serve, run_systemd_unit, run_wait_ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moeserve.server")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add, run in (("serve", add_serve_arguments, run_serve),
                           ("wait-ready", add_wait_ready_arguments, run_wait_ready),
                           ("systemd-unit", add_systemd_unit_arguments, run_systemd_unit)):
        p = sub.add_parser(name)
        add(p)
        p.set_defaults(func=run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
