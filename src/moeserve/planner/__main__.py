"""``python -m moeserve.planner ...``: the plan command without the full CLI."""

import argparse
import sys

from moeserve.planner.plan_command import add_plan_arguments, run_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moeserve plan", description="Which parallel layout fits, and which wins.")
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
