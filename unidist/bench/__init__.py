"""Benchmarks runnable under any launcher: ``python -m unidist.bench <subcommand>`` (see ``__main__.py``), or
``unidist bench <subcommand> -n 2 --backend mpi -- <options>``, which starts it under the real launcher.

Importing this package imports nothing heavy: each benchmark imports torch and its engine when it runs.
"""

MEASURE = ("collectives", "gradsync", "train")  # measured inside one unidist.init()
OFFLINE = ("plot", "report", "model")  # no launcher: they read JSON files or start the launchers themselves
DELEGATED = {"check": "unidist.bench.check", "zero": "unidist.bench.zero", "checkpoint": "unidist.bench.checkpoint",
             "ddp_digits": "unidist.bench.ddp_digits", "parallel": "unidist.bench.parallel",
             "accumulate": "unidist.bench.accumulate", "step": "unidist.bench.step",
             "startup": "unidist.bench.startup"}
SUBCOMMANDS = (*MEASURE, "all", *OFFLINE, *DELEGATED)
