"""Checkpoints whose format depends on neither the backend, nor the world size, nor the ZeRO stage.

A checkpoint is a directory: ``manifest.json`` (format version, every model state-dict entry's name, shape
and dtype, the optimizer's class, parameter names and param groups, which file holds which slice of which
tensor, and each file's size and sha256), ``meta.pt`` (param-group settings, per-parameter scalars such as
Adam's step, the caller's ``extra``) and one ``shard-R-of-N.pt`` per saving rank holding the slices of the
*full* tensors that rank owns. A run saved by N ranks at stage s on one backend loads on M ranks at stage s'
on another: each rank reads the slices it needs. Writes are atomic (files.py); loads use
``torch.load(weights_only=True)`` after checking sizes and checksums, and every rank validates the whole
checkpoint against the model and optimizer before anything is modified.

This layer knows files, manifests, checksums and cross-rank agreement only. What a rank holds is described
by a ``Layout`` (layout.py) that the prepared optimizer makes (``checkpoint_layout(model)``); the training
layer's ``Trainer.save_checkpoint``/``load_checkpoint`` hand it to ``save``/``load`` here with the world
communicator. A model prepared with ``group=`` (data parallel within a tensor- or pipeline-parallel job)
is saved as one *part* per data-parallel group, numbered by the groups' lowest world ranks: each group
writes and reads its own shard set, and a checkpoint loads where the job has as many parts.

A save has three parts (``Staged``): ``stage``, the collective start (temporary directory, this rank's slices
copied to host memory, ``meta.pt`` serialized); ``write``, this rank's files, with no collective; ``finish``,
the collective end (agreement, manifest, atomic publication). ``save`` runs them in a row; a background save
(background.py) runs ``write`` on a thread and ``finish`` when waited for.

Hosts need not share a filesystem (hosts.py): each host is given its own directory, keeps its ranks' shards
and a copy of the one manifest; detected at save with no setting, resumed on the same hosts (or any hosts
that hold every file between them), and a ``CheckpointMissingError`` says which files are on no host.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unidist.checkpoint import digest, foreign
from unidist.checkpoint.agree import World, temporary_beside
from unidist.checkpoint.agree import agree as _agree
from unidist.checkpoint.files import (
    FORMAT,
    MANIFEST,
    VERSION,
    Pace,
    digest_bytes,
    latest,
    load_bytes,
    publish,
    remove_old,
    resolve,
    save_bytes,
    save_tensors,
    writer,
)
from unidist.checkpoint.layout import MASTER, FullLayout, Layout, Pieces, check_params
from unidist.checkpoint.local_disks import agreed_manifest, fetch, host_id, host_name, rank_domains, storage
from unidist.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, InvalidArgumentError

__all__ = ["FullLayout", "Layout", "Staged", "World", "finish", "latest_checkpoint", "load", "save", "stage", "write"]


def _parts(world: World, layout: Layout) -> tuple[int, list[tuple[int, ...]]]:
    """This rank's part and every part's world ranks: one part per data-parallel communicator, in the order
    of their lowest world ranks (the whole world is the one part of a model prepared without ``group=``)."""
    seen: list[tuple[int, ...]] = [tuple(r) for r in world.allgather_object(tuple(layout.ranks))]
    parts = sorted(set(seen), key=min)
    members = [r for part in parts for r in part]
    if any(rank not in ranks for rank, ranks in enumerate(seen)) or len(members) != len(set(members)):
        raise InvalidArgumentError(
            "save_checkpoint/load_checkpoint: the models' data-parallel groups do not partition the world "
            f"(each rank's group, by world rank: {seen}); every rank must pass a model prepared over a group it "
            "belongs to, the groups disjoint (as mgr.split() makes them)")
    return parts.index(tuple(layout.ranks)), parts


@dataclass
class Staged:
    """A save between its two collective halves: this rank's snapshot, and where it goes.

    ``stage`` (every rank; collectives) makes it, ``write`` (this rank alone; no collective, so a background
    thread may run it while the training thread runs collectives) writes this rank's files, and ``finish``
    (every rank; collectives) agrees on the result, writes the manifest and publishes. ``save`` is the three
    in a row; unidist.checkpoint.background runs ``write`` on a thread."""

    final: Path
    tmp: Path
    part: int
    parts: list[tuple[int, ...]]
    descriptions: list[dict[str, Any]]  # each part's state description, part order
    zero_stage: int
    keep: int | None
    pieces: Pieces  # this rank's slices, copies in host memory (released once written)
    meta: bytes  # meta.pt as written (rank 0; empty elsewhere): serialized at stage, so a snapshot too
    created: bool  # whether this rank removes the temporary directory if the save fails

    def abandon(self) -> None:
        """An unfinished save leaves no temporary directory behind, on any host."""
        if self.created:
            shutil.rmtree(self.tmp, ignore_errors=True)


def save(mgr: World, path: str | os.PathLike[str], layout: Layout, *, keep: int | None = None,
         extra: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory atomically; every rank of ``mgr`` (the world) calls it with its layout
    (``layout.optimizer`` None: the model only). See ``Manager.save_checkpoint``."""
    staged = stage(mgr, path, layout, keep=keep, extra=extra)
    info, problem = write(staged, mgr.rank, mgr.size)
    return finish(mgr, staged, info, problem)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.detach().to("cpu")


def stage(mgr: World, path: str | os.PathLike[str], layout: Layout, *, keep: int | None = None,
          extra: dict[str, Any] | None = None) -> Staged:
    """The collective start of a save: the temporary directory on every host, this rank's slices copied to
    host memory (``layout.pieces()`` makes copies, and is a collective on DeepSpeed), ``meta.pt`` serialized
    on rank 0 (``extra`` that will not load with weights_only is refused here, on every rank)."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise InvalidArgumentError(f"save_checkpoint(keep={keep!r}) must be an int >= 1, or None to keep all")
    final = Path(path).absolute()
    part, parts = _parts(mgr, layout)
    tmp = temporary_beside(mgr, final)
    problem: BaseException | None = None
    created = mgr.rank == 0  # who removes the temporary directory if the save fails
    try:
        try:
            if not tmp.is_dir():  # this host does not see rank 0's directory: no shared filesystem (hosts.py)
                tmp.mkdir(parents=True, exist_ok=True)
                created = True
        except OSError as err:
            problem = CheckpointError(f"rank {mgr.rank} on {host_name()} cannot create {tmp}: {err}")
        _agree(mgr, problem)
        pieces = layout.pieces()  # a collective on DeepSpeed engines: every rank, same order
        pieces = {"model": {k: (s, _host(t)) for k, (s, t) in pieces["model"].items()},
                  "optim": {n: {k: (s, _host(t)) for k, (s, t) in st.items()} for n, st in pieces["optim"].items()}}
        meta = layout.meta()
        # each part's description and meta, from its first member (one part: rank 0's own)
        described = [(layout.describe(), meta)]
        if len(parts) > 1:
            leads = mgr.allgather_object((part, layout.describe(), meta) if layout.rank == 0 else None)
            described = [(d, m) for _, d, m in sorted((x for x in leads if x is not None), key=lambda x: x[0])]
        meta_bytes = b""
        if mgr.rank == 0:
            try:
                meta_bytes = _serialized({"meta": described[0][1], "extra": dict(extra or {}),
                                          **({"parts": [m for _, m in described]} if len(parts) > 1 else {})})
            except CheckpointCorruptError as err:
                problem = CheckpointError(f"save_checkpoint(extra=...) holds something torch.load(weights_only=True) "
                                          f"refuses; pass tensors, numbers, strings, lists and dicts ({err.__cause__})")
        _agree(mgr, problem)
    except BaseException:
        if created:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Staged(final, tmp, part, parts, [d for d, _ in described], layout.zero_stage, keep, pieces, meta_bytes,
                  created)


def _serialized(obj: Any) -> bytes:
    """torch.save into memory, refused now if torch.load(weights_only=True) would refuse it later."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise CheckpointCorruptError("cannot be pickled") from err
    data = buf.getvalue()
    load_bytes(data, "meta.pt", *digest_bytes(data))
    return data


def write(staged: Staged, rank: int, size: int, pace: Pace | None = None
          ) -> tuple[dict[str, Any] | None, BaseException | None]:
    """This rank's files into the temporary directory: (its manifest entry, None), or (None, the error). No
    collective and no exception, so a background thread may run it (``pace``: its throttle); ``finish`` agrees
    on the outcome."""
    tmp, pieces = staged.tmp, staged.pieces
    try:
        shard = tmp / f"shard-{rank:05d}-of-{size:05d}.pt"
        nbytes, sha = save_tensors(pieces, shard, pace) if pace is not None else save_tensors(pieces, shard)
        info = {"file": shard.name, "bytes": nbytes, "sha256": sha,
                **({"part": staged.part} if len(staged.parts) > 1 else {}),
                "digests": digest.to_hex(digest.of_pieces(pieces)),
                "model": {k: [s, s + t.numel()] for k, (s, t) in pieces["model"].items()},
                "optim": {n: {k: [s, s + t.numel()] for k, (s, t) in st.items()} for n, st in pieces["optim"].items()}}
        if staged.meta:
            save_bytes(staged.meta, tmp / "meta.pt")
    except Exception as err:  # reported to every rank by finish: nobody waits alone
        return None, CheckpointError(f"rank {rank} cannot write {tmp}: {type(err).__name__}: {err}")
    finally:
        staged.pieces = {"model": {}, "optim": {}}  # the snapshot's memory goes as soon as it is on disk
    return info, None


def finish(mgr: World, staged: Staged, info: dict[str, Any] | None, problem: BaseException | None) -> Path:
    """The collective end of a save: agree that every rank wrote its files, find the storage domains, write the
    manifest (rank 0) and publish, remove old checkpoints (``keep``). Raises the first rank's error on every
    rank, and then the temporary directory is gone."""
    final, tmp, parts = staged.final, staged.tmp, staged.parts
    try:
        gathered = mgr.allgather_object((info if problem is None else None, host_id()))
        infos = [g[0] for g in gathered]
        _agree(mgr, problem if problem is not None else (CheckpointError("a rank failed to write its shard")
                                                         if any(i is None for i in infos) else None))
        # which ranks see which shards: one storage domain (a shared filesystem) or one per host (hosts.py)
        found, views = rank_domains(mgr, tmp, final, infos, [g[1] for g in gathered])
        if len(found) > 1:
            for entry, view in zip(infos, views, strict=True):
                entry["host"] = view[0]
        manifest: dict[str, Any] = {}
        if mgr.rank == 0:
            try:
                meta_size, meta_sha = digest_bytes(staged.meta)
                keys = [_state_keys([i for i in infos if i.get("part", 0) == k]) for k in range(len(parts))]
                sums = [digest.to_hex(digest.add(digest.from_hex(i["digests"]) for i in infos
                                                 if i.get("part", 0) == k)) for k in range(len(parts))]
                manifest = {"format": FORMAT, "version": VERSION, "writer": writer(), "created_ns": time.time_ns(),
                            "backend": mgr.backend, "world_size": mgr.size, "zero_stage": staged.zero_stage,
                            "state": staged.descriptions[0], "state_keys": keys[0], "digests": sums[0],
                            "files": infos, "meta": {"file": "meta.pt", "bytes": meta_size, "sha256": meta_sha}}
                if len(parts) > 1:
                    manifest["parts"] = [{"ranks": list(ranks), "state": d, "state_keys": k, "digests": h}
                                         for ranks, d, k, h in zip(parts, staged.descriptions, keys, sums, strict=True)]
                if len(found) > 1:
                    manifest["storage"] = storage(found, views, infos)
                else:
                    publish(tmp, final, manifest)
                    if staged.keep is not None:
                        remove_old(final.parent, staged.keep)
            except (OSError, CheckpointError) as err:
                problem = CheckpointError(f"cannot publish {final}: {err}")
        if len(found) > 1:  # no shared filesystem: each domain's first rank publishes its own copy
            _agree(mgr, problem)
            manifest, meta_bytes = mgr.broadcast_object((manifest, staged.meta) if mgr.rank == 0 else None, 0)
            if mgr.rank in (d[0] for d in found[1:]):
                try:
                    save_bytes(meta_bytes, tmp / manifest["meta"]["file"])
                except OSError as err:
                    problem = CheckpointError(f"rank {mgr.rank} on {host_name()} cannot write {tmp}: {err}")
            lead = mgr.rank in (d[0] for d in found)
            if lead and problem is None:
                try:
                    publish(tmp, final, manifest)
                except OSError as err:
                    problem = CheckpointError(f"rank {mgr.rank} cannot publish {final} on {host_name()}: {err}")
            # older checkpoints go only once every host has the new one: a save interrupted between the hosts'
            # publications leaves the previous checkpoint on every host, to be resumed from
            _agree(mgr, problem)
            if lead and staged.keep is not None:
                try:
                    remove_old(final.parent, staged.keep)
                except OSError as err:
                    problem = CheckpointError(f"rank {mgr.rank} cannot remove old checkpoints on {host_name()}: {err}")
        _agree(mgr, problem)
    except BaseException:
        staged.abandon()
        raise
    return final


def _state_keys(infos: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Every optimizer state key saved per parameter name, over one part's files."""
    keys: dict[str, set[str]] = {}
    for i in infos:
        for name, st in i["optim"].items():
            keys.setdefault(name, set()).update(st)
    return {n: sorted(k) for n, k in keys.items()}


def _check(state: dict[str, Any], layout: Layout, with_optimizer: bool, path: Path) -> None:
    """The first difference between the checkpoint and the model/optimizer, as a CheckpointMismatchError."""
    saved, mine = state["model"], layout.describe()["model"]
    for name, want in mine.items():
        got = saved.get(name)
        if got is None:
            raise CheckpointMismatchError(f"{path}: the model has {name!r} ({want['dtype']} {want['shape']}) but the "
                                          "checkpoint does not")
        if got != want:
            raise CheckpointMismatchError(f"{path}: {name!r} is {got['dtype']} {got['shape']} in the checkpoint and "
                                          f"{want['dtype']} {want['shape']} in the model")
    for name in saved:
        if name not in mine:
            raise CheckpointMismatchError(f"{path}: the checkpoint has {name!r}, which the model does not")
    if not with_optimizer:
        return
    opt = state.get("optimizer")
    want_opt = layout.describe()["optimizer"]
    if opt is None:
        raise CheckpointMismatchError(f"{path} was saved without an optimizer; load it with optimizer=None")
    if opt["class"] != want_opt["class"]:
        raise CheckpointMismatchError(f"{path} holds {opt['class']} state and the optimizer is {want_opt['class']}")
    check_params(path, dict(zip(opt["params"], opt["groups"], strict=True)), want_opt)


class _Reader:
    """Slices of full tensors, assembled from the shard files that hold them."""

    def __init__(self, path: Path, files: list[dict[str, Any]], data: list[Any]) -> None:
        self.path = path
        self.files = files
        self.data = data

    def read(self, kind: str, name: str, key: str, start: int, end: int) -> torch.Tensor:
        out: torch.Tensor | None = None
        covered = 0
        for info, data in zip(self.files, self.data, strict=True):
            span = info[kind].get(name) if kind == "model" else info[kind].get(name, {}).get(key)
            if not span or span[1] <= start or span[0] >= end:
                continue
            s, e = max(start, span[0]), min(end, span[1])
            src = data[kind][name][1] if kind == "model" else data[kind][name][key][1]
            if out is None:
                out = torch.empty(end - start, dtype=src.dtype)
            out[s - start:e - start] = src[s - span[0]:e - span[0]]
            covered += e - s
        if covered != end - start or (out is None and end > start):
            raise CheckpointCorruptError(f"{self.path}: no file holds all of {kind} {name!r} {key} "
                                         f"[{start}, {end})")
        return out if out is not None else torch.empty(0)


def load(mgr: World, path: str | os.PathLike[str], layout: Layout) -> dict[str, Any]:
    """Load a checkpoint into what ``layout`` describes (``layout.optimizer`` None: the model only); returns
    ``extra``. Every rank of ``mgr`` (the world) calls it."""
    where = resolve(Path(path).absolute())
    with_optimizer = layout.optimizer is not None
    problem: BaseException | None = None
    reader: _Reader | None = None
    state_keys: dict[str, list[str]] = {}
    inner_meta: dict[str, Any] = {"param_groups": [], "scalars": {}}
    meta: dict[str, Any] = {}
    part, parts = _parts(mgr, layout)  # its errors are the same on every rank
    # another engine's checkpoint (foreign.py) where no rank's host has a manifest: every rank looks, then all agree
    found: foreign.Foreign | None = None
    unreadable: BaseException | None = None
    if not (where / MANIFEST).is_file():
        try:
            found = foreign.detect(where)
        except CheckpointError as err:
            unreadable = err
    _agree(mgr, unreadable)
    if mgr.allgather_object(found is not None) == [True] * mgr.size and found is not None:
        return foreign.load(mgr, found, layout, where)
    manifest = agreed_manifest(mgr, where)  # read here, or received from a host that has it (hosts.py)
    try:
        saved_parts = manifest.get("parts")
        if len(saved_parts or [None]) != len(parts):
            raise CheckpointMismatchError(
                f"{where} holds {len(saved_parts or [None])} data-parallel part(s) and this job's models form "
                f"{len(parts)} (one per data-parallel group of prepare(group=...)); load it with the same tensor/"
                "pipeline-parallel layout it was saved with")
        saved = saved_parts[part] if saved_parts else manifest
        _check(saved["state"], layout, with_optimizer, where)
    except (CheckpointError, InvalidArgumentError) as err:
        problem = err
    _agree(mgr, problem)
    try:
        files = [f for f in manifest["files"] if f.get("part", 0) == part]
        # each file from this host's directory, or sent by a rank whose host has it (hosts without a shared
        # filesystem); a file on no host of the job is a CheckpointMissingError naming it
        data = fetch(mgr, where, manifest, {manifest["meta"]["file"], *(f["file"] for f in files)})
        meta = data[manifest["meta"]["file"]]
        reader = _Reader(where, files, [data[f["file"]] for f in files])
        if with_optimizer:
            state_keys, inner_meta = saved["state_keys"], meta["parts"][part] if saved_parts else meta["meta"]
    except (CheckpointError, InvalidArgumentError) as err:
        problem = err
    _agree(mgr, problem)  # nothing was modified on any rank if any of them found a problem
    if reader is None:  # unreachable: _agree raised
        raise CheckpointError(f"{where}: could not be read")
    layout.load(reader.read, inner_meta, state_keys)
    _prove(mgr, layout, [(p.get("digests") if saved_parts else manifest.get("digests"))
                         for p in (saved_parts or [manifest])], parts, where, inner_meta if with_optimizer else None)
    return dict(meta.get("extra", {}))


def _prove(mgr: World, layout: Layout, saved: list[dict[str, Any] | None], parts: list[tuple[int, ...]],
           where: Path, meta: dict[str, Any] | None) -> None:
    """After a load, every rank's slices of what the model and optimizer now hold add up, part by part, to the
    digests the writer recorded (one gather of a few integers per tensor), and the optimizer's scalars equal the
    saved ones; otherwise a CheckpointMismatchError on every rank names the tensors. A format-1 manifest has
    no digests: only the scalars are compared."""
    # views of what the model and optimizer hold (no second copy of the state); a collective on DeepSpeed engines
    terms = digest.of_pieces(layout.pieces(copy=False))
    everyone = mgr.allgather_object(terms)
    wrong: list[str] = []
    for ranks, want in zip(parts, saved, strict=True):
        if want is None:
            continue
        got = digest.add(everyone[r] for r in ranks)
        expected = digest.from_hex(want)
        if layout.optimizer is None:
            expected["optim"] = {}
        wrong += digest.differences(expected, got, skip=(MASTER,))
    if meta is not None:
        now = layout.meta()["scalars"]
        wrong += [f"optimizer scalar {k!r} of {n!r}" for n, st in meta["scalars"].items() for k, v in st.items()
                  if not _same(now.get(n, {}).get(k), v)]
    problem = None
    if wrong:
        problem = CheckpointMismatchError(
            f"{where}: after the load, {wrong[0]}{f' and {len(wrong) - 1} more' if len(wrong) > 1 else ''} "
            "differ from what the writer saved (the manifest's digests): the files do not hold what was saved, "
            "or the load put values in the wrong place. The model and optimizer now hold these wrong values: load "
            f"another checkpoint before training. All: {', '.join(wrong[:20])}{' ...' if len(wrong) > 20 else ''}")
    _agree(mgr, problem)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            torch.equal(a.detach().cpu(), b.detach().cpu())
    return bool(a == b)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directly inside ``directory`` (None if there is none)."""
    return latest(Path(directory))
