"""One package per engine, each holding everything only that engine knows: its record (``record.py``, registered
with ``unidist.registry`` when this package is imported), its Engine and Manager (``manager.py``), and for
DeepSpeed and Horovod their trainer and the pieces only it uses. What every engine shares lives in comm/, train/,
checkpoint/ and parallel/.

Nothing here imports an engine, torch or a manager until a record's call is made. The import order is the
order of preference: ``unidist launch`` without ``--backend`` takes the first whose launcher is installed.
"""

# isort: off
from unidist.engines.local import record as local
from unidist.engines.mpi import record as mpi
from unidist.engines.torch import record as torch
from unidist.engines.deepspeed import record as deepspeed
from unidist.engines.horovod import record as horovod
# isort: on
from unidist.engines.training import unidist_training

__all__ = ["deepspeed", "horovod", "local", "mpi", "torch", "unidist_training"]
