"""One package per engine, each holding everything only that engine knows: its record (``record.py``, registered
with ``unidist.registry`` when this package is imported), its Engine and Manager (``manager.py``), and for
DeepSpeed and Horovod their trainer and the pieces only it uses. What every engine shares lives in comm/, train/,
checkpoint/ and parallel/.

Nothing here imports an engine, torch or a manager until a record's call is made. The import order is the
order of preference: ``unidist launch`` without ``--backend`` takes the first whose launcher is installed.
"""

# each import registers that engine's record (no name here shadows an engine's package); the order is preference
# isort: off
import unidist.engines.local.record
import unidist.engines.mpi.record
import unidist.engines.torch.record
import unidist.engines.deepspeed.record
import unidist.engines.horovod.record  # noqa: F401
# isort: on
from unidist.engines.training import unidist_training

__all__ = ["unidist_training"]
