"""torch distributed checkpoint (DCP) directories, read without a process group: any slice of any full tensor a
``dcp.save`` of ``get_state_dict``'s ``{"model": ..., "optim": ...}`` wrote (FSDP2, DDP or one process; torchtitan's
layout), for a load onto any engine, world size and stage.

A DCP directory holds ``.metadata`` (read with torch's own ``FileSystemReader``: every entry's flattened name and its
path in the saved dict, each tensor's shape, dtype and *chunks* — the boxes each writer held — and where each chunk
lies: a file, an offset and a length) and one ``__R_0.distcp`` file per writer, each chunk stored as a ``torch.save``
of that box and each non-tensor entry as a ``torch.save`` of the value. A slice ``[start, end)`` of a flattened
tensor is assembled from the chunks that cover its rows: a rank reads the chunks its layout's part touches, each
chunk once, under ``torch.load(weights_only=True)``.

Names: ``model.<fqn>`` entries are the model's state dict; ``optim.state.<fqn>.<key>`` the optimizer state (a tied
weight's under the first of its names, as ``get_optimizer_state_dict`` keeps it); ``optim.param_groups.<i>.<key>``
the groups' settings and parameter names. Every other top-level entry (``step``, a scheduler's or a dataloader's
state) comes back as the load's extra dict.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from unidist.errors import CheckpointCorruptError, CheckpointError

__all__ = ["DCPFiles", "find"]

METADATA = ".metadata"


def find(path: Path) -> Path | None:
    """``path`` if it is a DCP directory."""
    return path if (path / METADATA).is_file() else None


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointCorruptError(f"{path / METADATA} cannot be read by torch's FileSystemReader: "
                                     f"{type(err).__name__}: {err}") from err


class DCPFiles:
    """One DCP checkpoint's tensors by name, as slices of the full tensors."""

    def __init__(self, path: Path) -> None:
        self.dir = path
        md = _reader(path)
        self.version = str(getattr(md, "version", "?"))
        self.entries: dict[tuple[Any, ...], tuple[str, Any]] = {}  # path in the saved dict -> (flat key, metadata)
        for key, meta in md.state_dict_metadata.items():
            self.entries[tuple(md.planner_data.get(key, (key,)))] = (key, meta)
        self.storage: dict[str, list[tuple[Any, Any]]] = {}  # flat key -> [(MetadataIndex, _StorageInfo)]
        for index, info in md.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{path}: {index.fqn} is stored transformed ({info.transform_descriptors}); "
                                      "this unidist reads DCP's plain FileSystemWriter files only")
            self.storage.setdefault(index.fqn, []).append((index, info))
        missing = sorted({info.relative_path for infos in self.storage.values() for _, info in infos
                          if not (path / info.relative_path).is_file()})
        if missing:  # before anything is loaded
            raise CheckpointCorruptError(f"{path}: {', '.join(missing)} missing (each writing rank wrote one)")
        ends: dict[str, int] = {}
        for infos in self.storage.values():
            for _, info in infos:
                ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        short = [(f, n) for f, n in sorted(ends.items()) if (path / f).stat().st_size < n]
        if short:
            raise CheckpointCorruptError(f"{path / short[0][0]} is truncated: {(path / short[0][0]).stat().st_size} "
                                         f"bytes, the .metadata places data up to byte {short[0][1]}")
        self.writers = len({info.relative_path for infos in self.storage.values() for _, info in infos})
        self.model = {p[1]: meta for p, (_, meta) in self.entries.items() if len(p) == 2 and p[0] == "model"}
        state: dict[str, dict[str, Any]] = {}
        for p, (_, meta) in self.entries.items():
            if len(p) == 4 and p[:2] == ("optim", "state"):
                state.setdefault(p[2], {})[p[3]] = meta
        self.state = state
        self.shapes = {n: tuple(m.size) for n, m in self.model.items() if _is_tensor(m)}
        self._chunks: dict[tuple[str, int], torch.Tensor] = {}
        self.alias: dict[str, str] = {}
        groups = sorted({p[2] for p in self.entries if len(p) == 4 and p[:2] == ("optim", "param_groups")},
                        key=int)  # the list's indices, as planner_data keeps them
        self.settings = [{p[3]: self._value(p) for p in self.entries
                          if len(p) == 4 and p[:3] == ("optim", "param_groups", i) and p[3] != "params"}
                         for i in groups]
        self.groups = [list(self._value(("optim", "param_groups", i, "params"))) for i in groups]
        self.params = [n for g in self.groups for n in g]

    # ---------------------------------------------------------------------------------------------- naming
    def bind(self, names: list[str]) -> None:
        """Map the loading optimizer's parameter names onto the checkpoint's: a tied weight the model calls by
        another of its names is the one saved parameter of that shape no other name claims."""
        unclaimed = [n for n in self.params if n not in set(names)]
        for name in names:
            if name in self.state or name in self.params:
                continue
            shape = self.shapes.get(name)
            match = [n for n in unclaimed if self.shapes.get(n) == shape]
            if len(match) == 1:
                self.alias[name] = match[0]
                unclaimed.remove(match[0])

    def canonical(self, name: str) -> str:
        return self.alias.get(name, name)

    # ---------------------------------------------------------------------------------------------- reading
    def _bytes(self, info: Any) -> bytes:
        with open(self.dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointCorruptError(f"{self.dir / info.relative_path} is truncated: {len(data)} of "
                                         f"{info.length} bytes at offset {info.offset}")
        return data

    def _load(self, info: Any, what: str) -> Any:
        try:
            return torch.load(io.BytesIO(self._bytes(info)), map_location="cpu", weights_only=True)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointCorruptError(f"{self.dir / info.relative_path}: {what} cannot be read: "
                                         f"{type(err).__name__}: {str(err).splitlines()[0]}") from err

    def _value(self, path: tuple[Any, ...]) -> Any:
        """A whole entry: a non-tensor value, or a tensor assembled from its chunks."""
        key, meta = self.entries[path]
        if _is_tensor(meta):
            n = int(torch.Size(meta.size).numel())
            return self._slice(key, meta, 0, n).view(tuple(meta.size))
        return self._load(self.storage[key][0][1], key)

    def _slice(self, key: str, meta: Any, start: int, end: int) -> torch.Tensor:
        shape = tuple(meta.size)
        if not shape:  # 0-d: one chunk
            return self._chunk(key, 0).reshape(-1)[start:end]
        row = int(torch.Size(shape[1:]).numel())
        r0, r1 = (start // row, -(-end // row)) if row else (0, 0)
        out = torch.empty((r1 - r0, *shape[1:]), dtype=meta.properties.dtype)
        covered = 0
        for i, (index, _) in enumerate(self.storage.get(key, [])):
            lo, n = int(index.offset[0]), int(self._chunk_sizes(meta, index)[0])
            a, b = max(lo, r0), min(lo + n, r1)
            if a >= b:
                continue
            chunk = self._chunk(key, i)
            box = tuple(slice(int(o), int(o) + int(s)) for o, s in zip(index.offset[1:], chunk.shape[1:], strict=True))
            out[tuple([slice(a - r0, b - r0), *box])] = chunk[a - lo:b - lo]
            covered += (b - a) * int(torch.Size(chunk.shape[1:]).numel())
        if covered != out.numel():
            raise CheckpointCorruptError(f"{self.dir}: the chunks of {key!r} cover {covered} of the {out.numel()} "
                                         f"elements in rows [{r0}, {r1})")
        return out.reshape(-1)[start - r0 * row:end - r0 * row]

    @staticmethod
    def _chunk_sizes(meta: Any, index: Any) -> tuple[int, ...]:
        chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
        return tuple(int(s) for s in chunk.sizes)

    def _chunk(self, key: str, i: int) -> torch.Tensor:
        """Chunk ``i`` of ``key``; the chunks of one tensor are kept while it is read (its slices, one after the
        other), not the whole checkpoint's."""
        if self._chunks and next(iter(self._chunks))[0] != key:
            self._chunks.clear()
        if (key, i) not in self._chunks:
            value = self._load(self.storage[key][i][1], key)
            if not isinstance(value, torch.Tensor):
                raise CheckpointCorruptError(f"{self.dir}: {key!r} holds {type(value).__name__}, not a tensor")
            self._chunks[(key, i)] = value
        return self._chunks[(key, i)]

    def read(self, kind: str, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the full flattened tensor: a model entry or a parameter's optimizer state."""
        if kind == "model":
            flat, meta = self.entries[("model", name)]
        else:
            flat, meta = self.entries[("optim", "state", self.canonical(name), key)]
        return self._slice(flat, meta, start, end)

    # ---------------------------------------------------------------------------------------------- what it says
    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)

    def dtype_of(self, name: str) -> torch.dtype:
        dtype: torch.dtype = self.model[name].properties.dtype
        return dtype

    def state_keys(self) -> dict[str, list[str]]:
        out = {n: sorted(k for k, m in st.items() if _is_tensor(m) and tuple(m.size) == self.shapes.get(n))
               for n, st in self.state.items()}
        return {**out, **{a: out[s] for a, s in self.alias.items() if s in out}}

    def scalars(self) -> dict[str, dict[str, Any]]:
        out = {n: {k: self._value(("optim", "state", n, k)) for k, m in st.items()
                   if not (_is_tensor(m) and tuple(m.size) == self.shapes.get(n))} for n, st in self.state.items()}
        return {**out, **{a: out[s] for a, s in self.alias.items() if s in out}}

    def optimizer_classes(self) -> set[str] | None:
        return None  # DCP does not record the optimizer's class

    def extra(self) -> dict[str, Any]:
        """Every entry outside ``model`` and ``optim``, as the nested dict that was saved."""
        out: dict[str, Any] = {}
        for p in self.entries:
            if p[0] in ("model", "optim"):
                continue
            node = out
            for part in p[:-1]:
                node = node.setdefault(str(part), {})
            node[str(p[-1])] = self._value(p)
        return out

    def files(self) -> list[Path]:
        return [self.dir / METADATA, *sorted({self.dir / info.relative_path for infos in self.storage.values()
                                              for _, info in infos})]

    def optimizer_name(self) -> str:
        return "the saved optimizer's" if self.state else "no optimizer's"

    def describe(self) -> str:
        said = f", step {self._value(('step',))}" if ("step",) in self.entries else ""
        return (f"a torch distributed checkpoint (DCP {self.version}, {self.writers} writer file(s), "
                f"{len(self.model)} model entries{', optimizer state' if self.state else ''}{said})")


def _is_tensor(meta: Any) -> bool:
    return hasattr(meta, "chunks")
