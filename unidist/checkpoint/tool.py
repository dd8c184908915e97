"""``unidist checkpoint inspect`` and ``unidist checkpoint export``: a checkpoint read with no model, no job and
no engine, as a file.

``inspect`` says what a checkpoint holds and whether it is intact: format and writer, world size, stage, parts,
tensors and sizes, and every check a load makes without a model (each file's size and sha256, each file's
digest terms and, per tensor, their sum against the manifest's digest: see digest.py). ``export`` writes the
model's full state dict under the model's own names to one ``.safetensors`` or ``.pt`` file, assembling one
tensor at a time from memory-mapped shards, so a sharded ZeRO checkpoint becomes one file without the job
that wrote it (DeepSpeed ships its zero_to_fp32 script for this; FSDP users call ``dcp_to_torch_save``).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from unidist.checkpoint import digest
from unidist.checkpoint.files import MANIFEST, file_digest, read_manifest, resolve
from unidist.checkpoint.foreign import Foreign, detect
from unidist.checkpoint.layout import dtype_named
from unidist.errors import CheckpointCorruptError, CheckpointError, CheckpointMissingError, InvalidArgumentError

__all__ = ["SAFETENSORS_DTYPES", "ForeignOpened", "Opened", "export", "inspect_lines", "open_checkpoint"]

# torch dtype -> safetensors' name for it (the format's table: https://github.com/huggingface/safetensors)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
Progress = Callable[[int, int, str], None]  # (tensors done, of, name)


class Opened:
    """A unidist checkpoint directory, read offline: its manifest, and its shard files memory-mapped when
    first needed (a tensor's slices are read from the pages that hold them, not the whole file)."""

    def __init__(self, path: str | os.PathLike[str], part: int | None = None) -> None:
        self.path = resolve(Path(path).absolute())
        if not (self.path / MANIFEST).is_file() and Path(path).is_dir():
            raise CheckpointError(f"{path} is neither a unidist checkpoint (no {MANIFEST}) nor a DeepSpeed one (no "
                                  "latest file or mp_rank_00_model_states.pt) nor a torch DCP one (no .metadata)")
        self.manifest = read_manifest(self.path)
        self.parts: list[dict[str, Any]] = self.manifest.get("parts") or [self.manifest]
        if part is None and len(self.parts) > 1:
            raise InvalidArgumentError(f"{self.path} holds {len(self.parts)} data-parallel parts (one per tensor- "
                                       f"or pipeline-parallel group); choose one with --part 0..{len(self.parts) - 1}")
        self.part = part or 0
        if not 0 <= self.part < len(self.parts):
            raise InvalidArgumentError(f"--part {part}: {self.path} holds parts 0..{len(self.parts) - 1}")
        self.files = [f for f in self.manifest["files"] if f.get("part", 0) == self.part]
        self._loaded: dict[str, Any] = {}

    @property
    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.parts[self.part]["state"]
        return state

    def model(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The model's state-dict entries: (name, shape, dtype), in the model's order."""
        return [(k, tuple(v["shape"]), dtype_named(v["dtype"])) for k, v in self.state["model"].items()]

    def _data(self, entry: dict[str, Any]) -> Any:
        name = entry["file"]
        if name not in self._loaded:
            file = self.path / name
            if not file.is_file():
                raise CheckpointMissingError(f"{file} is missing (a checkpoint saved without a shared filesystem "
                                             "keeps each host's shards on that host: copy them here)")
            try:
                self._loaded[name] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:
                raise CheckpointCorruptError(f"{file} cannot be read: {type(err).__name__}: {err}") from err
        return self._loaded[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The model entry ``name`` whole, from the slices the shards hold."""
        shape, dtype = next((s, d) for k, s, d in self.model() if k == name)
        n = int(torch.Size(shape).numel())
        out = torch.empty(n, dtype=dtype)
        covered = 0
        for entry in self.files:
            span = entry["model"].get(name)
            if span and span[1] > span[0]:
                out[span[0]:span[1]] = self._data(entry)["model"][name][1]
                covered += span[1] - span[0]
        if covered != n:
            raise CheckpointCorruptError(f"{self.path}: the shards hold {covered} of {name!r}'s {n} elements")
        return out.view(shape)

    def check(self) -> Iterator[tuple[str, bool, str]]:
        """Every check that needs no model: (what, passed, detail), files first, then each tensor's digest."""
        meta = self.manifest["meta"]
        for entry in [meta, *self.files]:
            file = self.path / entry["file"]
            if not file.is_file():
                yield entry["file"], False, "missing"
                continue
            size, sha = file_digest(file)
            ok = size == entry["bytes"] and sha == entry["sha256"]
            yield entry["file"], ok, "size and sha256 match" if ok else \
                f"{size} bytes, sha256 {sha[:12]}; the manifest says {entry['bytes']}, {entry['sha256'][:12]}"
        want = self.parts[self.part].get("digests")
        if want is None:
            yield "digests", True, f"none recorded (format {self.manifest['version']})"
            return
        terms = []
        for entry in self.files:
            try:
                mine = digest.of_pieces(self._data(entry))
            except CheckpointError as err:
                yield entry["file"], False, str(err)
                return
            if "digests" in entry and digest.to_hex(mine) != entry["digests"]:
                yield entry["file"], False, "its tensors' digest terms differ from the manifest's"
            terms.append(mine)
        wrong = digest.differences(digest.from_hex(want), digest.add(terms))
        count = len(want["model"]) + sum(len(v) for v in want["optim"].values())
        yield "digests", not wrong, (f"{count} tensors, each adds up to its digest" if not wrong else
                                     f"{len(wrong)} of {count} differ: {', '.join(wrong[:5])}")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _header(ck: Opened) -> list[str]:
    m, state = ck.manifest, ck.state
    wrote = m.get("writer", {})
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m["created_ns"] / 1e9))
    opt = state.get("optimizer")
    keys = ck.parts[ck.part].get("state_keys", {})
    per = sorted({k for v in keys.values() for k in v})
    return [f"{ck.path}: a unidist checkpoint (format {m['version']}), written by unidist "
            f"{wrote.get('unidist', '< 0.1 (format 1)')} with torch {wrote.get('torch', '?')} on {when}",
            f"saved by {m['world_size']} rank(s) on the {m['backend']} backend at ZeRO stage {m['zero_stage']}"
            + (f"; part {ck.part} of {len(ck.parts)}" if len(ck.parts) > 1 else ""),
            f"optimizer: {opt['class']} over {len(opt['params'])} parameters; per-element state "
            f"{', '.join(per) or 'none'}" if opt else "optimizer: none saved",
            f"files: {len(ck.files)} shard(s) and {m['meta']['file']}, "
            f"{_size(sum(f['bytes'] for f in ck.files) + m['meta']['bytes'])}"]


def inspect_lines(ck: Opened | ForeignOpened, tensors: bool = False) -> tuple[list[str], bool]:
    """What ``unidist checkpoint inspect`` prints, and whether every check passed."""
    head = ck.header() if isinstance(ck, ForeignOpened) else _header(ck)
    model = ck.model()
    elements = sum(int(torch.Size(s).numel()) for _, s, _ in model)
    nbytes = sum(int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size() for _, s, d in model)
    dtypes = sorted({str(d).removeprefix("torch.") for _, _, d in model})
    lines = [*head[:2], f"model: {len(model)} tensors, {elements:,} elements, {_size(nbytes)} ({', '.join(dtypes)})",
             *head[2:]]
    ok, files_ok = True, 0
    for what, passed, detail in ck.check():
        ok &= passed
        if what not in ("digests", "pieces") and passed:  # a file
            files_ok += 1
        else:
            lines.append(f"{'check' if passed else 'FAILED'} {what}: {detail}")
    if ok:
        lines.insert(-1, f"check files: {files_ok} files, " + ("sizes and sha256 match" if isinstance(ck, Opened)
                                                                 else "each read"))
    if tensors:
        notes = ck.parts[ck.part].get("digests", {"model": {}})["model"] if isinstance(ck, Opened) else {}
        lines += [f"  {k}  {list(s)}  {str(d).removeprefix('torch.')}  {notes.get(k, '')}".rstrip()
                  for k, s, d in model]
    return lines, ok


class ForeignOpened:
    """A checkpoint another engine wrote (foreign.py: DeepSpeed's, torch DCP's), read offline: DeepSpeed's weights as
    its float32 masters (what its zero_to_fp32 script gives), everything else as saved."""

    def __init__(self, files: Foreign) -> None:
        self.files = files
        self.path = files.dir

    def model(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, shape, self.files.dtype_of(name)) for name, shape in self.files.model_shapes().items()]

    def tensor(self, name: str) -> torch.Tensor:
        shape, dtype = next((s, d) for k, s, d in self.model() if k == name)
        return self.files.read("model", name, "", 0, int(torch.Size(shape).numel())).to(dtype).view(shape)

    def header(self) -> list[str]:
        f = self.files
        keys = sorted({k for v in f.state_keys().values() for k in v})
        names = [p.name for p in f.files()]
        return [f"{self.path}: {f.describe()}", "no digests in this format: each tensor is read whole to check it",
                f"optimizer: {f.optimizer_name()} over {len(f.params)} parameters; per-element state "
                f"{', '.join(keys) or 'none'}",
                f"files: {len(names)} ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}), "
                f"{_size(sum(p.stat().st_size for p in f.files()))}"]

    def check(self) -> Iterator[tuple[str, bool, str]]:
        """Every tensor read whole from the files: the foreign formats record no digests, only names, shapes and
        where each piece lies (a file that cannot be read raised when the checkpoint was opened)."""
        for file in self.files.files():
            yield file.name, True, "read"
        count = 0
        try:
            for name, _, _ in self.model():
                self.tensor(name)
                count += 1
            for name, keys in self.files.state_keys().items():
                numel = int(torch.Size(self.files.model_shapes()[name]).numel())
                for key in keys:
                    self.files.read("optim", name, key, 0, numel)
                    count += 1
        except CheckpointError as err:
            yield "pieces", False, str(err)
            return
        yield "pieces", True, f"{count} tensors, each read whole from its pieces (the format records no digests)"


def open_checkpoint(path: str | os.PathLike[str], part: int | None = None) -> Opened | ForeignOpened:
    """The checkpoint at ``path``: unidist's own, or one real DeepSpeed wrote."""
    where = resolve(Path(path).absolute())
    if not (where / MANIFEST).is_file():
        found = detect(where)
        if found is not None:
            return ForeignOpened(found)
    return Opened(path, part)


def _bar(done: int, of: int, name: str) -> None:
    width = 30
    fill = width * done // max(of, 1)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{of} {name[:40]:<40}")
    if done == of:
        sys.stderr.write("\n")
    sys.stderr.flush()


def export(ck: Opened | ForeignOpened, out: str | os.PathLike[str], progress: Progress | None = None) -> Path:
    """The model's full state dict to ``out`` (``.safetensors`` or ``.pt``), written to a temporary file beside
    it and renamed when complete. ``progress``: called after each tensor (None: a bar on stderr if a terminal)."""
    target = Path(out)
    if target.suffix not in (".safetensors", ".pt"):
        raise InvalidArgumentError(f"unidist checkpoint export: {out} must end in .safetensors or .pt")
    if progress is None and sys.stderr.isatty():
        progress = _bar
    model = ck.model()
    unsupported = sorted({str(d) for _, _, d in model if d not in SAFETENSORS_DTYPES})
    if target.suffix == ".safetensors" and unsupported:
        raise InvalidArgumentError(f"safetensors has no {', '.join(unsupported)}: export to a .pt file instead")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent.absolute())
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            (_safetensors if target.suffix == ".safetensors" else _torch_save)(ck, model, f, tmp, progress)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _safetensors(ck: Opened | ForeignOpened, model: list[tuple[str, tuple[int, ...], torch.dtype]], f: Any, tmp: Path,
                 progress: Progress | None) -> None:
    """The header first (every shape and dtype is in the manifest), then each tensor's bytes as assembled."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": str(ck.path)}}
    offset = 0
    for name, shape, dtype in model:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)) + text)
    for i, (name, _, _) in enumerate(model):
        f.write(_bytes_of(ck.tensor(name)))
        if progress is not None:
            progress(i + 1, len(model), name)


def _torch_save(ck: Opened | ForeignOpened, model: list[tuple[str, tuple[int, ...], torch.dtype]], f: Any, tmp: Path,
                progress: Progress | None) -> None:
    """torch.save needs every tensor at once: they are assembled into memory-mapped scratch files beside the
    output, one per dtype (torch.save refuses one storage viewed as two dtypes), pages the kernel can write
    back and drop, then saved from there."""
    starts: list[int] = []
    ends: dict[torch.dtype, int] = {}
    for _, shape, dtype in model:  # each tensor 64-byte aligned in its dtype's scratch, as torch's storages are
        at = ends.get(dtype, 0)
        starts.append(at)
        size = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        ends[dtype] = at + -(-size // 64) * 64
    scratch = {dt: tmp.with_name(f"{tmp.name}.{str(dt).removeprefix('torch.')}") for dt in ends}
    try:
        rooms = {dt: torch.from_file(str(scratch[dt]), shared=True, size=max(1, n), dtype=torch.uint8)
                 for dt, n in ends.items()}
        state = {}
        for i, ((name, shape, dtype), start) in enumerate(zip(model, starts, strict=True)):
            size = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
            view = rooms[dtype][start:start + size].view(dtype).view(shape)
            view.copy_(ck.tensor(name))
            state[name] = view
            if progress is not None:
                progress(i + 1, len(model), name)
        torch.save(state, f)
    finally:
        for file in scratch.values():
            file.unlink(missing_ok=True)


def main(ns: Any) -> int:
    """Run ``unidist checkpoint inspect|export`` (the arguments: unidist/cli.py): 0 done, 1 a check failed, 2
    the checkpoint cannot be read."""
    try:
        ck = open_checkpoint(ns.checkpoint, ns.part)
        if ns.action == "inspect":
            lines, ok = inspect_lines(ck, ns.tensors)
            print("\n".join(lines))
            return 0 if ok else 1
        out = export(ck, ns.out)
        print(f"wrote {out}: {len(ck.model())} tensors, {_size(out.stat().st_size)}")
        return 0
    except (CheckpointError, InvalidArgumentError) as err:
        print(f"unidist checkpoint {ns.action}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
