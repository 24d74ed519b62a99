import sys

from moeserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
