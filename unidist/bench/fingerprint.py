"""What the training fingerprint costs (``UNIDIST_FINGERPRINT``, ``unidist verify``): a step with and without it.

    python -m unidist.bench.fingerprint                       # one process
    mpiexec -n 2 python -m unidist.bench.fingerprint          # two ranks: the fingerprint's one reduction too

Two models of each kind, identical, prepared alike except that one records a fingerprint; their training steps
alternate in interleaved rounds (``timing.interleaved``), so load hits both columns alike. Kinds: the digits MLP
of examples/train_digits.py (13k parameters, a step of a few milliseconds: the worst case, the fixed cost per
step shows) and GPT-2 4x256 (the model ``bench step`` trains). Printed: each step time (the slowest rank's
median), the difference per step and the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import unidist
from unidist.bench.gpt import GPT2, GPT2Config
from unidist.bench.machine import line as machine_line
from unidist.bench.timing import interleaved, slowest

__all__ = ["main"]


def _digits() -> tuple[Callable[[], torch.nn.Module], Callable[[torch.nn.Module, int], torch.Tensor]]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(24, 64), torch.randint(0, 10, (24,))
    return make, lambda m, _: torch.nn.functional.cross_entropy(m(x), y)


def _gpt() -> tuple[Callable[[], torch.nn.Module], Callable[[torch.nn.Module, int], torch.Tensor]]:
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab=8192, n_positions=128)

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2(config)
    ids = torch.randint(0, config.vocab, (4, 128))
    return make, lambda m, _: m(ids, ids)


def run(mgr: unidist.Manager, rounds: int, out: Path) -> list[str]:
    rows = []
    for name, (make, loss_of) in {"digits MLP": _digits(), "GPT-2 4x256": _gpt()}.items():
        columns = {}
        for mode in ("off", "on"):
            model = make()
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            trace = str(out / f"{name.split()[0]}-{mode}.jsonl") if mode == "on" else None
            model, opt = mgr.prepare(model, opt, fingerprint=trace)

            def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt,
                     loss_of: Callable[[torch.nn.Module, int], torch.Tensor] = loss_of) -> None:
                mgr.backward(loss_of(model, 0))
                opt.step()
                opt.zero_grad()
            step()  # the first step allocates the optimizer state (and the fingerprint's file)
            columns[mode] = step
        iters = 20 if name.startswith("digits") else 3
        times = slowest(mgr, interleaved(mgr, columns, iters=iters, rounds=rounds))
        off, on = times["off"], times["on"]
        rows.append(f"| {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {(on - off) * 1e3:+.2f} | {on / off:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unidist.bench.fingerprint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(unidist.script_args() if argv is None else argv)
    with unidist.init() as mgr, tempfile.TemporaryDirectory() as tmp:
        rows = run(mgr, args.rounds, Path(tmp))
        if mgr.is_main:
            print(machine_line())
            print(f"\nA training step without and with the fingerprint, {mgr.backend} backend, {mgr.size} rank(s), "
                  f"median of {args.rounds} interleaved rounds (ms):\n")
            print("| model | off | on | difference | ratio |\n|---|---|---|---|---|")
            print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
