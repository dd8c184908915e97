"""unidist's own backends, one record each (see ``unidist.registry``); importing this registers them.

Each module holds one engine's registration and the engine's own calls the benchmarks compare with. Nothing
here imports an engine, torch or a manager until a record's call is made. The import order is the order of
preference: ``unidist launch`` without ``--backend`` takes the first whose launcher is installed.
"""

# isort: off
from unidist.backends import local, mpi, torch, deepspeed, horovod
# isort: on
from unidist.backends.local import unidist_training

__all__ = ["deepspeed", "horovod", "local", "mpi", "torch", "unidist_training"]
