"""Run one script as ``python SCRIPT ARGS`` would (runpy, ``__name__ == "__main__"``), for real DeepSpeed's runs
after marking its shared-memory comm op unavailable (``--no-shm-comm``: harness.skip_shm_comm_build says why).

    python run_plain.py [--no-shm-comm] SCRIPT [ARGS...]

The deepspeed launcher puts its ``--local_rank=N`` first; it goes on to the script, after the script's own.
"""

from __future__ import annotations

import runpy
import sys

from harness import skip_shm_comm_build


def main() -> None:
    local = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    if args[:1] == ["--no-shm-comm"]:
        skip_shm_comm_build()
        args = args[1:]
    sys.argv = args + local
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
