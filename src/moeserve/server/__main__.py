"""``python -m moeserve.server serve|wait-ready|systemd-unit ...``: the same as ``moeserve ...``."""

import sys

from moeserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
