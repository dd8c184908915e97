"""Every horovod.torch API case of hvd_cases*.py in one launch, on unidist.compat.horovod or real Horovod.

``--impl compat`` imports ``unidist.compat.horovod as hvd``, ``--impl horovod`` the real ``horovod.torch``:
the same table either way. Writes ``<out>/rank<R>.json``: per case the encoded items (tensors as dtype,
shape and values; errors as the class name and its builtin bases) or the case's own uncaught error, and
``_meta`` (impl, backend, size, wall seconds of the cases).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hvd_cases_more  # noqa: F401  (extends CASES)
import numpy as np
import torch
from hvd_cases import CASES, Err, members, x

import unidist

BUILTINS = ("ValueError", "TypeError", "RuntimeError", "AttributeError", "IndexError", "NotImplementedError",
            "KeyError", "TimeoutError")


class Captured:
    """An exception a case expected and caught, to be encoded."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def encode(item: Any) -> Any:
    """A case item as JSON: tensors/arrays as dtype, shape, values; errors as class and builtin bases."""
    if isinstance(item, torch.Tensor):
        t = item.detach().cpu()
        return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                "values": t.reshape(-1).tolist()}
    if isinstance(item, np.generic):  # numpy's 0-d results
        item = np.asarray(item)
    if isinstance(item, np.ndarray):
        return {"dtype": str(item.dtype), "shape": list(item.shape), "values": item.reshape(-1).tolist()}
    if isinstance(item, Err):
        return {"error": item.base, "bases": [item.base]}
    if isinstance(item, Captured):
        return {"error": type(item.exc).__name__, "message": str(item.exc)[:300],
                "bases": [c.__name__ for c in type(item.exc).__mro__ if c.__name__ in BUILTINS]}
    if isinstance(item, (list, tuple)):
        return [encode(i) for i in item]
    if item is None or isinstance(item, (bool, int, float, str)):
        return item
    raise TypeError(f"cannot encode {type(item).__name__}")


class Ctx:
    """What a case sees: hvd, torch, rank, size, the even-rank process set, inputs, capture."""

    def __init__(self, hvd: Any, ps: Any) -> None:
        self.hvd, self.torch, self.ps = hvd, torch, ps
        self.r, self.n = hvd.rank(), hvd.size()

    def t(self, name: str, shape: tuple[int, ...], dtype: str = "float32") -> torch.Tensor:
        return torch.from_numpy(x(name, self.r, shape, dtype).copy())

    @staticmethod
    def capture(fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # the case expects some calls to raise: record which
            return Captured(exc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("compat", "horovod"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(unidist.script_args())  # without the launcher's own (deepspeed's --local_rank)
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # Horovod's switch for add_process_set after init
    if args.impl == "compat":
        import unidist.compat.horovod as hvd
    else:
        import horovod.torch as hvd  # type: ignore[no-redef]
    n = unidist.detect().size
    ps = hvd.ProcessSet(members(n)) if n > 1 else None
    hvd.init(process_sets=[ps] if ps is not None else None)
    backend = hvd.basics.manager().backend if args.impl == "compat" else "horovod.torch"
    ctx = Ctx(hvd, ps)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    for case in CASES:
        if ctx.n < case.min_size or (args.impl == "horovod" and not case.horovod) or \
                (case.checked and os.environ.get("UNIDIST_CHECK_COLLECTIVES") != "1"):
            continue
        try:
            results[case.name] = {"items": encode(case.run(ctx))}
        except Exception as exc:  # recorded for the test to show; the table goes on
            results[case.name] = {"uncaught": encode(Captured(exc)), "trace": traceback.format_exc()[-2000:]}
    results["_meta"] = {"impl": args.impl, "backend": backend, "size": ctx.n,
                        "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{ctx.r}.json").write_text(json.dumps(results))
    hvd.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
