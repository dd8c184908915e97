"""Checkpoints on hosts that do not share a filesystem: who sees which files, and getting the rest.

Each rank is given a checkpoint directory (the same path string on every host, e.g. ``/tmp/ckpt`` on each
node's local disk, or a different path per host). Nothing needs configuring: at save every rank writes its
shard into the (temporary) directory as its path names it (creating it if its host does not see rank 0's);
after the shards' allgather (a barrier), the first rank of every host (name + boot id) tries to open the
first shard of every host (``visible``: an open, which NFS revalidates, not a cached stat): those shards
are the per-host markers. Hosts that see the same markers form a *storage domain*; one domain of every
host is a shared filesystem, and then the checkpoint is written exactly as before (rank 0 writes
``meta.pt`` and the manifest and publishes: old checkpoints and readers are unaffected). Otherwise each
domain's lowest rank publishes its directory with the domain's shards, a copy of ``meta.pt`` and a copy of
the one manifest, which also lists the domains (``storage``: hosts, ranks, path, files) and each shard's
``host``; older checkpoints are removed (``keep``) only once every host has published. Domains must
partition the hosts (each sees exactly its own domain's files): anything else is a mount problem, refused
with what each host saw. The ranks of one host are assumed to see the same directory.

Why a replicated manifest rather than a manifest on rank 0's host plus a small index per host: every host's
directory is then a complete checkpoint by itself (``latest_checkpoint`` needs no collective and finds it on
every host, retention and the atomic rename work per host unchanged), resuming on the same hosts needs no
copying of anything, and copying the hosts' directories together yields exactly the checkpoint a shared
filesystem would have held (same manifest, the union of the shards). The manifest and meta.pt are small.

On load the ranks first agree on one manifest (``agreed_manifest``): a rank whose host has none gets it from
one that has (a host added since the save); two different checkpoints under the path (a save interrupted
between hosts' publications) are refused, naming who sees which. Then every file a rank needs that its host
does not hold is sent by a rank whose host does (``fetch``, in chunks over ``broadcast_object``): the same
layout works, and so does any other as long as every file is on some host of the job. A file on no host is a
``CheckpointMissingError`` naming the files, the ranks and hosts that wrote them, where, and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from unidist.checkpoint.agree import World, agree
from unidist.checkpoint.files import MANIFEST, load_bytes, load_tensors, read_manifest
from unidist.errors import CheckpointError, CheckpointMissingError

__all__ = ["CHUNK", "agreed_manifest", "domains", "fetch", "host_id", "host_name", "rank_domains", "storage",
           "visible"]

CHUNK = 1 << 26  # bytes per broadcast_object when a file is sent: well under MPI's 2 GiB message limit


def host_name() -> str:
    return socket.gethostname()


def host_id() -> str:
    """This machine: its name and boot id (containers on different machines may share a name). The ranks of
    one machine are taken to see the same files, so only its first rank looks at the others' (not N x N
    opens on a shared filesystem at scale)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{host_name()}/{boot}"


def visible(path: Path) -> bool:
    """Whether this host can open ``path`` (an open, not a stat: NFS revalidates on open)."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError:
        return False
    return True


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def domains(views: list[tuple[str, str, list[bool]]], where: Path) -> list[list[int]]:
    """The storage domains over hosts, lowest first, from each host's (name, path, whether it sees each host's
    files); one domain: a shared filesystem. A CheckpointError (the same on every rank) if they do not
    partition the hosts."""
    groups: dict[tuple[bool, ...], list[int]] = {}
    for host, (_, _, seen) in enumerate(views):
        groups.setdefault(tuple(seen), []).append(host)
    found = sorted(groups.values(), key=min)
    if any([h for h, s in enumerate(views[d[0]][2]) if s] != d for d in found):
        report = "; ".join(f"{views[h][0]} sees the files of "
                           f"{', '.join(views[o][0] for o, s in enumerate(views[h][2]) if s) or 'no host'}"
                           for h in range(len(views)))
        raise CheckpointError(f"cannot save {where}: the hosts see each other's files inconsistently ({report}); "
                              "every host must see either all ranks' files (one shared filesystem) or only its "
                              "own ranks' (a directory of its own): check how the directory is mounted on each host")
    return found


def rank_domains(mgr: World, tmp: Path, final: Path, infos: list[dict[str, Any]], keys: list[str]
                 ) -> tuple[list[list[int]], list[tuple[str, str, Any]]]:
    """The storage domains as lists of ranks, and each rank's (host name, path, ...): every host's first rank
    opens every host's first shard in ``tmp`` (a marker per host: written, then looked for after the shards'
    allgather, the barrier)."""
    hosts = list(dict.fromkeys(keys))
    leads = [keys.index(h) for h in hosts]
    seen = [visible(tmp / infos[r]["file"]) for r in leads] if mgr.rank in leads else None
    views = mgr.allgather_object((host_name(), str(final), seen))
    found = domains([views[r] for r in leads], final)
    return [[r for r, k in enumerate(keys) if hosts.index(k) in d] for d in found], views


def storage(found: list[list[int]], views: list[tuple[str, str, list[bool]]],
            infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's ``storage`` section: per domain its hosts, ranks, directory and shard files."""
    return [{"hosts": sorted({views[r][0] for r in d}), "ranks": d, "path": views[d[0]][1],
             "files": [infos[r]["file"] for r in d]} for d in found]


def _digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _when(ns: int | None) -> str:
    if ns is None:
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns // 1_000_000 % 1000:03d} UTC"


def _by_host(views: list[Any], ranks: list[int]) -> str:
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(views[r][0], []).append(r)
    return ", ".join(f"{h} (rank{'s' if len(rs) > 1 else ''} {_ranks(rs)})" for h, rs in hosts.items())


def agreed_manifest(mgr: World, where: Path) -> dict[str, Any]:
    """The one manifest every rank loads: read where the host has it, else received from a rank that has."""
    manifest: dict[str, Any] | None = None
    problem: CheckpointError | None = None
    try:
        manifest = read_manifest(where)
    except CheckpointError as err:
        problem = err
    absent = manifest is None and not (where / MANIFEST).exists()
    agree(mgr, None if absent else problem)  # a damaged or foreign manifest on any host fails every rank
    views = mgr.allgather_object((host_name(), str(where), None if manifest is None else
                                  (_digest(manifest), manifest.get("created_ns"))))
    keys = sorted({v[2] for v in views if v[2] is not None}, key=lambda k: k[1] or 0)
    if not keys:
        raise problem or CheckpointError(f"{where} is not a complete unidist checkpoint")
    if len(keys) > 1:
        groups = [f"{_by_host(views, [r for r, v in enumerate(views) if v[2] == k])} the one saved at "
                  f"{_when(k[1])}" for k in keys]
        none = [r for r, v in enumerate(views) if v[2] is None]
        groups += [f"{_by_host(views, none)} none"] if none else []
        raise CheckpointError(
            f"{where}: the ranks do not see the same checkpoint ({'; '.join(groups)}). Hosts without a shared "
            "filesystem each keep their own copy, and a save interrupted between hosts leaves them different "
            "(latest_checkpoint answers per host): pass every rank a checkpoint all hosts completed, or copy the "
            "hosts' directories together")
    holders = [r for r, v in enumerate(views) if v[2] is not None]
    if len(holders) < mgr.size:
        manifest = mgr.broadcast_object(manifest if mgr.rank == holders[0] else None, holders[0])
    if manifest is None:  # unreachable: this rank read it or received it
        raise CheckpointError(f"{where}: no manifest")
    return manifest


def _send(mgr: World, path: Path, size: int, root: int) -> bytes:
    """The contents of ``path`` on ``root``'s host, on every rank (what root cannot read arrives short, and
    fails the receivers' size check)."""
    parts = []
    f = None
    if mgr.rank == root:
        try:
            f = open(path, "rb")
        except OSError:
            f = None
    try:
        for _ in range(max(1, -(-size // CHUNK))):
            chunk = b""
            if f is not None:
                try:
                    chunk = f.read(CHUNK)
                except OSError:
                    chunk = b""
            parts.append(mgr.broadcast_object(chunk if mgr.rank == root else None, root))
    finally:
        if f is not None:
            f.close()
    return b"".join(parts)


def fetch(mgr: World, where: Path, manifest: dict[str, Any], wanted: set[str]) -> dict[str, Any]:
    """The loaded contents of the files in ``wanted`` (names in the manifest), by name: read from this host's
    directory, or sent by a rank whose host holds the file. Every rank calls it (collectives inside)."""
    entries = [manifest["meta"], *manifest["files"]]
    names = [e["file"] for e in entries]
    keys: list[str] = mgr.allgather_object(host_id())  # a host's first rank looks for the files
    look = keys.index(keys[mgr.rank]) == mgr.rank
    need = [i for i, n in enumerate(names) if n in wanted]
    views = mgr.allgather_object((host_name(), [i for i, n in enumerate(names) if visible(where / n)] if look
                                  else None, need))
    views = [(v[0], views[keys.index(k)][1], v[2]) for v, k in zip(views, keys, strict=True)]
    have = views[mgr.rank][1]
    lacking = sorted({i for _, h, n in views for i in n if i not in h})
    holders = {i: [r for r, v in enumerate(views) if i in v[1]] for i in lacking}
    nowhere = [i for i in lacking if not holders[i]]
    if nowhere:  # the same on every rank: raised everywhere before any file was sent
        raise CheckpointMissingError(missing_message(where, manifest, nowhere, views))
    out: dict[str, Any] = {}
    problem: CheckpointError | None = None
    for i in lacking:
        e, root = entries[i], holders[i][0]
        data = _send(mgr, where / e["file"], int(e["bytes"]), root)
        if i in need and i not in have:
            try:
                out[e["file"]] = load_bytes(data, f"{e['file']} (sent by rank {root} from {views[root][0]})",
                                            int(e["bytes"]), e["sha256"])
            except CheckpointError as err:  # raised after the last send, so no rank waits alone
                problem = problem or err
    if problem is not None:
        raise problem
    for i in need:
        if i in have:
            out[names[i]] = load_tensors(where / names[i], entries[i]["bytes"], entries[i]["sha256"])
    return out


def missing_message(where: Path, manifest: dict[str, Any], missing: list[int], views: list[Any]) -> str:
    """What is missing (``missing``: indices into [meta, *files]), who wrote it where, and how to fix it."""
    job = _by_host(views, list(range(len(views))))
    domains_ = manifest.get("storage")
    if not domains_:  # saved on one shared filesystem: the files were lost since
        what = ", ".join(manifest["meta"]["file"] if i == 0 else f"{manifest['files'][i - 1]['file']} (rank "
                         f"{i - 1}'s)" for i in missing)
        return (f"checkpoint file(s) {what} are missing from {where} on every host of this job ({job}); restore "
                "them, or resume from another checkpoint")
    lines, lacking = [], []
    for d in domains_:
        files = [manifest["files"][i - 1]["file"] for i in missing if i > 0
                 and manifest["files"][i - 1]["file"] in d["files"]]
        ranks = [r for r in d["ranks"] if _index(manifest, r) in missing]
        if files:
            lacking.append(d)
            lines.append(f"{', '.join(files)} (written by rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} on "
                         f"{', '.join(d['hosts'])} into its {d['path']})")
    if 0 in missing:
        lines.append(f"{manifest['meta']['file']} (a copy on every host that saved)")
    saved = "; ".join(f"{', '.join(d['hosts'])}: ranks {_ranks(d['ranks'])} in {d['path']}" for d in domains_)
    first = (lacking or domains_)[0]
    example = f"rsync -a {first['hosts'][0]}:{first['path']}/ {where}/"
    return (f"{where}: no host of this job has {'; '.join(lines)}. The checkpoint was saved on hosts without a "
            f"shared filesystem, each keeping its own ranks' shards in its own directory ({saved}); this job runs "
            f"on {job}. Copy every saving host's directory into this one on each host of the job (e.g. `{example}`), "
            "resume on the hosts that saved it, or save to a directory every host shares")


def _index(manifest: dict[str, Any], rank: int) -> int:
    """The index into [meta, *files] of the shard rank ``rank`` wrote."""
    return rank + 1 if rank < len(manifest["files"]) else -1
