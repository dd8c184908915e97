"""`unidist info` as a Python script, for launchers that start scripts rather than programs (torchrun)."""

import sys

from unidist.cli import main

if __name__ == "__main__":
    sys.exit(main(["info", *sys.argv[1:]]))
