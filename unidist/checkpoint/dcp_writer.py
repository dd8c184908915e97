"""``save_checkpoint(..., format="dcp")``: a torch distributed checkpoint (DCP) directory that FSDP2's and DDP's
own scripts load with ``dcp.load`` of ``get_state_dict``'s ``{"model": ..., "optim": ...}``, written from any
engine, world size and ZeRO stage, each rank writing the slices it owns (no rank gathers the model).

DCP describes each writer's part of a tensor as a box (offsets and sizes in every dimension); a unidist rank owns
a flat slice of the flattened tensor, which is written as the few boxes that tile it (``boxes``: the rest of a first
partial row, whole rows, the start of a last partial row, recursively in the inner dimensions). Each rank writes
``__R_0.distcp`` (every box a ``torch.save`` of its tensor, at a recorded offset, as torch's FileSystemWriter
stores them); rank 0 writes the non-tensor entries and ``.metadata``: torch's own ``Metadata`` dataclasses,
pickled as FileSystemWriter pickles them. The names are the ones ``get_state_dict`` uses: ``model.<fqn>`` for
every state-dict entry, ``optim.state.<fqn>.<key>`` and ``optim.param_groups.<i>.<key>`` with a tied weight under
its first name; every ``extra`` entry is a top-level entry. The directory is written under a temporary name and
renamed when complete.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from unidist.checkpoint.agree import World, agree, agree_or_discard, temporary_beside
from unidist.checkpoint.files import rename_into_place
from unidist.checkpoint.layout import MASTER, Layout, dtype_named
from unidist.errors import CheckpointError, InvalidArgumentError

__all__ = ["boxes", "save_dcp"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, the box's first element in the flat tensor)


def boxes(shape: tuple[int, ...], start: int, end: int) -> Iterator[Box]:
    """The boxes that tile elements [start, end) of a tensor of ``shape`` flattened in row-major order."""
    if end <= start:
        return
    if not shape:
        yield (), (), 0
        return
    inner = int(torch.Size(shape[1:]).numel())
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    rest = len(shape) - 1
    if r0 == r1:  # inside one row
        for off, size, at in boxes(shape[1:], c0, c1):
            yield (r0, *off), (1, *size), r0 * inner + at
        return
    if c0:  # the end of a first, partial row
        for off, size, at in boxes(shape[1:], c0, inner):
            yield (r0, *off), (1, *size), r0 * inner + at
        r0 += 1
    if r1 > r0:
        yield (r0, *([0] * rest)), (r1 - r0, *shape[1:]), r0 * inner
    if c1:  # the start of a last, partial row
        for off, size, at in boxes(shape[1:], 0, c1):
            yield (r1, *off), (1, *size), r1 * inner + at


def _version() -> str | None:
    """The DCP format version this torch writes (what its FileSystemWriter stamps)."""
    import torch.distributed.checkpoint.filesystem as fs

    return getattr(fs, "CURRENT_DCP_VERSION", None)


def _dcp_classes() -> Any:
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return md, _StorageInfo


def save_dcp(mgr: World, path: str | os.PathLike[str], layout: Layout, extra: dict[str, Any],
             first_names: dict[str, str]) -> Path:
    """Write a DCP directory of ``layout``'s state (every rank calls it); ``first_names``: each optimizer
    parameter's name as ``get_state_dict`` gives it (a tied weight's first name), by the layout's name for it."""
    if len(set(mgr.allgather_object(tuple(layout.ranks)))) != 1:
        raise InvalidArgumentError("save_checkpoint(format='dcp') saves a model prepared over the whole world (without "
                                   "prepare(group=...)); use unidist's format for tensor- and pipeline-parallel jobs")
    final = Path(path).absolute()
    tmp = temporary_beside(mgr, final)
    problem: BaseException | None = None
    try:
        records = _write_rank(mgr, layout, tmp)
        problem = None
    except (OSError, CheckpointError) as err:
        records, problem = [], CheckpointError(f"rank {mgr.rank} cannot write {tmp}: {err}")
    agree(mgr, problem)
    meta = layout.meta()  # rank-identical: param-group settings and scalars
    everyone = mgr.allgather_object(records)
    try:
        if mgr.rank == 0:
            _finish(tmp, final, layout, meta, extra, first_names, [r for rank in everyone for r in rank])
    except (OSError, CheckpointError, pickle.PicklingError) as err:
        problem = CheckpointError(f"cannot publish {final}: {type(err).__name__}: {err}")
    agree_or_discard(mgr, problem, tmp)
    return final


def _write_rank(mgr: World, layout: Layout, tmp: Path) -> list[tuple[str, tuple[int, ...], tuple[int, ...], str, str,
                                                                    int, int]]:
    """This rank's boxes into ``__R_0.distcp``: [(kind/name/key, offsets, sizes, dtype, file, offset, length)]."""
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp} is not visible on this rank's host: format='dcp' needs a filesystem every "
                              "rank shares")
    # views (each box is copied as it is written, in the foreground); a collective on DeepSpeed engines
    pieces = layout.pieces(copy=False)
    for name, st in pieces["optim"].items():  # a half-precision weight's float32 master is the weight FSDP2 keeps
        if MASTER in st:
            pieces["model"][name] = st[MASTER]
    shapes = {n: tuple(s) for n, (s, _) in layout.shapes.items()}
    param_shapes = {n: shapes[n] for n in layout.opt_names if n in shapes}
    file = f"__{mgr.rank}_0.distcp"
    out = []
    with open(tmp / file, "wb") as f:
        items = [(f"model/{n}", shapes[n], s, t) for n, (s, t) in pieces["model"].items()]
        items += [(f"optim/{n}/{k}", param_shapes[n], s, t) for n, st in pieces["optim"].items()
                  for k, (s, t) in st.items() if k != MASTER]
        for key, shape, start, flat in items:
            for off, size, at in boxes(shape, start, start + flat.numel()):
                n = int(torch.Size(size).numel())
                buf = io.BytesIO()
                torch.save(flat[at - start:at - start + n].detach().to("cpu", copy=True).view(size), buf)  # a GPU's too
                where = f.tell()
                f.write(buf.getvalue())
                out.append((key, off, size, str(flat.dtype), file, where, len(buf.getvalue())))
        f.flush()
        os.fsync(f.fileno())
    return out


def _finish(tmp: Path, final: Path, layout: Layout, meta: dict[str, Any], extra: dict[str, Any],
            first_names: dict[str, str], records: list[tuple[Any, ...]]) -> None:
    """Rank 0: the non-tensor entries, ``.metadata``, and the atomic rename."""
    md, storage_info = _dcp_classes()
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    shapes = {n: tuple(s) for n, (s, _) in layout.shapes.items()}
    param_shapes = {n: shapes[n] for n in layout.opt_names if n in shapes}

    def path_of(key: str) -> tuple[Any, ...]:
        kind, name, *rest = key.split("/")
        return ("model", name) if kind == "model" else ("optim", "state", first_names.get(name, name), *rest)

    by_key: dict[str, list[tuple[Any, ...]]] = {}
    for r in records:
        by_key.setdefault(r[0], []).append(r)
    for key, recs in by_key.items():
        flat_key = ".".join(str(p) for p in path_of(key))
        full = shapes[key.split("/")[1]] if key.startswith("model/") else param_shapes[key.split("/")[1]]
        dtype = dtype_named(recs[0][3])
        chunks = []
        for i, (_, off, size, _, file, where, length) in enumerate(recs):
            chunks.append(md.ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
            storage[md.MetadataIndex(flat_key, torch.Size(off), i)] = storage_info(file, where, length)
        state[flat_key] = md.TensorStorageMetadata(properties=md.TensorProperties(dtype=dtype),
                                                   size=torch.Size(full), chunks=chunks)
        planner[flat_key] = path_of(key)
    entries: list[tuple[tuple[Any, ...], Any]] = []
    for name, scalars in meta["scalars"].items():
        entries += [(("optim", "state", first_names.get(name, name), k), v) for k, v in scalars.items()]
    names = layout.opt_names
    for gi, settings in enumerate(meta["param_groups"]):
        entries += [(("optim", "param_groups", gi, k), v) for k, v in settings.items()]
        group = [first_names.get(n, n) for n, g in zip(names, layout.opt_groups, strict=True) if g == gi]
        entries.append((("optim", "param_groups", gi, "params"), group))
    entries += [((k,), v) for k, v in extra.items()]
    with open(tmp / "__0_0.distcp", "ab") as f:
        for p, value in entries:
            flat_key = ".".join(str(x) for x in p)
            buf = io.BytesIO()
            torch.save(value.detach().cpu() if isinstance(value, torch.Tensor) else value, buf)
            where = f.tell()
            f.write(buf.getvalue())
            if isinstance(value, torch.Tensor):
                state[flat_key] = md.TensorStorageMetadata(
                    properties=md.TensorProperties(dtype=value.dtype), size=value.shape,
                    chunks=[md.ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.shape)])
                storage[md.MetadataIndex(flat_key, torch.Size([0] * value.dim()), 0)] = \
                    storage_info("__0_0.distcp", where, len(buf.getvalue()))
            else:
                state[flat_key] = md.BytesStorageMetadata()
                storage[md.MetadataIndex(flat_key)] = storage_info("__0_0.distcp", where, len(buf.getvalue()))
            planner[flat_key] = p
        f.flush()
        os.fsync(f.fileno())
    metadata = md.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                           storage_meta=md.StorageMeta(checkpoint_id=str(final)), version=_version())
    with open(tmp / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    rename_into_place(tmp, final)
