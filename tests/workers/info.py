"""`unidist info` as a Python script, for launchers that start scripts rather than programs (torchrun)."""

import sys

import unidist
from unidist.cli import main

if __name__ == "__main__":
    sys.exit(main(["info", *unidist.script_args()]))  # deepspeed appends --local_rank=N
