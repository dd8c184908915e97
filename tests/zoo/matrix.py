"""Which zoo cells (model x ZeRO stage x precision) a launch runs, and how close each must come to one process.

The whole matrix is 13 models x 4 stages x 3 precisions on each of 5 backends. CI runs a sample, the same on every
run: on every backend each model at ZeRO-3 in float32 (where the defects were), plus one more (stage, precision)
cell per model that rotates with the model and the backend, so that over the five backends every model meets most
cells. ``ZOO_MATRIX=all`` in the environment of the test run runs every cell on every backend:

    ZOO_MATRIX=all python -m pytest -m "mpi or local" tests/multiproc/test_model_zoo.py   # one tox env's backends
"""

from __future__ import annotations

import os

STAGES = (0, 1, 2, 3)
PRECISIONS = ("32", "bf16-mixed", "bf16-master")
BACKENDS = ("local", "mpi", "torch", "deepspeed", "horovod")
STEPS = 3

# max |w - w_one_process| after STEPS steps, over every parameter and floating buffer. AdamW moves each weight by
# about lr = 1e-3 a step whatever the gradient's size, so float32 rounding in a gradient near zero can turn into a
# difference near lr: measured up to 2e-6 in float32 (see docs/models.md). bf16-mixed is compared with what DDP
# under autocast computes (reference.py), so the same bound holds; bf16-master with a bfloat16 model's per-rank
# gradients summed in bfloat16 and float32 copies stepped (reference.py): measured exact on mpi, torch and horovod.
TOLERANCE = {"32": 1e-5, "bf16-mixed": 1e-5, "bf16-master": 1e-5}

# Where an engine's own ZeRO computes otherwise, and by how much (measured; docs/models.md): DeepSpeed 0.19.8's ZeRO-3
# under torch_autocast ends 1.8e-3 (torch's TransformerEncoder, its linear1 weights most) and 6.7e-4 (nn.Transformer)
# away from the per-rank autocast reference with SGD at lr 0.05, where its stages 0-2 and its float32 ZeRO-3 are exact
# DeepSpeed's own bf16 (bf16-master) ends a bfloat16 step or two of the weights' magnitude away from the per-rank
# reference at stage 0 on every model (3.9e-3; the encoders 7.8e-3, branches 1.6e-2) and at stage 3 on four (BERT,
# T5, the encoders, up to 7.8e-3), where mpi, torch and Horovod are exact, as are DeepSpeed's stages 1-2. At stage 0
# the cause is in DeepSpeed 0.19.8: its FP16_UnfusedOptimizer (a half-precision model at stage 0 off fused kernels,
# as on CPU) builds the optimizer state by calling optimizer.step() once with zero gradients
# (runtime/fp16/unfused_optimizer.py:412-425), which applies AdamW's weight decay once more and advances Adam's step
# count; stage 3's smaller differences are not traced
ENGINE_BOUND = {("deepspeed", 3, "bf16-mixed"): 3e-3, **{("deepspeed", s, "bf16-master"): 3.2e-2 for s in STAGES}}


def tolerance(backend: str, stage: int, precision: str) -> float:
    """max |w - w_one_process| a cell may end with."""
    return ENGINE_BOUND.get((backend, stage, precision), TOLERANCE[precision])


def full() -> bool:
    """Whether this test run asks for the whole matrix (``ZOO_MATRIX=all``)."""
    return os.environ.get("ZOO_MATRIX", "") == "all"


def plan(models: dict[str, tuple[str, ...]], backend: str, whole: bool = False) -> list[tuple[str, int, str]]:
    """The (model, stage, precision) cells one launch of ``backend`` runs, in order.

    Args:
        models: the zoo's model names (in the zoo's order), each with the precisions it runs in.
        backend: the launch's backend (its place in BACKENDS turns the rotation).
        whole: every cell (``ZOO_MATRIX=all``).
    """
    every = [(s, p) for p in PRECISIONS for s in STAGES]
    if whole:
        return [(m, s, p) for m, ps in models.items() for s, p in every if p in ps]
    turn = BACKENDS.index(backend) if backend in BACKENDS else 0
    cells = []
    for i, (m, ps) in enumerate(models.items()):
        others = [c for c in every if c != (3, "32") and c[1] in ps]
        s, p = others[(i + 2 * turn) % len(others)]
        cells += [(m, 3, "32"), (m, s, p)]
    return cells
