"""``hvd.elastic``: Horovod's elastic API (``horovod.torch.elastic``) on unidist's launchers.

```python
@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        for state.batch in range(state.batch, batches_per_epoch):
            step()
            if state.batch % batches_per_commit == 0:
                state.commit()
        state.batch = 0

state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
state.register_reset_callbacks([lambda: rescale_lr(hvd.size())])
train(state)
```

The names and semantics are Horovod's: ``run``, ``State``, ``ObjectState``, ``TorchState`` (``commit``,
``restore``, ``sync``, ``save``, ``check_host_updates``, ``register_reset_callbacks``, ``on_reset``, the kwargs
as attributes) and ``ElasticSampler``. What differs is how a failure is survived. Horovod's driver re-forms
the world inside the running processes; unidist's engines cannot, so a commit is also written to disk (a
unidist checkpoint, see store.py) and the *launcher* restarts the job, which resumes from it:

- ``torchrun --max-restarts N``: a failed worker makes torchrun restart every worker (up to N times), and
  they resume from the last written commit.
- ``mpiexec``, ``horovodrun -np N`` (no elastic flags), ``deepspeed``: the job ends non-zero; run the same
  command again and it resumes from the last written commit.
- ``horovodrun --min-np/--max-np/--host-discovery-script``: refused with ``LaunchEnvironmentError`` (those
  need Horovod's own elastic driver).

Commits go to ``<root>/<job>``: the root is ``UNIDIST_ELASTIC_DIR`` (default: ``unidist-elastic-<uid>`` under
the system temp dir; a multi-host job must set it to a shared directory), the job ``UNIDIST_ELASTIC_JOB``
(default: the script's name and a hash of the working directory, the script and its arguments; not the world
size, so a rerun at another ``-n`` resumes). Rank 0 says the job's name and directory when it starts, and which
commit it resumes from, written when and by how many ranks; a second job of the same name running at once is
refused. Every ``commit()`` is written (a checkpoint: rank 0 says when writes cost over a quarter of the job's
time), or at most one every ``UNIDIST_ELASTIC_COMMIT_SECONDS`` when set; a restart redoes the batches since the
last *written* commit. When a job fails, the line saying which commit a rerun resumes from comes from the
failing rank, or from rank 0's watcher where the launcher kills every rank at once (mpiexec). The commits are
deleted when the decorated function returns. Worlds of another size resume a commit: checkpoints load at any
size and ``ElasticSampler`` re-deals the rest of the epoch; the reset callbacks run after a resume.
"""

from __future__ import annotations

from unidist.compat.horovod.elastic.run import run
from unidist.compat.horovod.elastic.sampler import ElasticSampler
from unidist.compat.horovod.elastic.state import ObjectState, State
from unidist.compat.horovod.elastic.torch_state import TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
