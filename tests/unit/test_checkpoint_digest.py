"""Every load proven: the per-tensor digest any split of a tensor computes, a tensor altered behind a valid file
checksum caught after the load, and the manifest's format and writer stamps (an unknown newer format refused).

The digest is compared with an independent pure-Python reference of its definition (docstring of
unidist/checkpoint/digest.py), on every dtype and on splits that cut 8-byte words in two.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from pathlib import Path

import pytest
import torch

import unidist
from unidist import CheckpointError, CheckpointMismatchError
from unidist.checkpoint import digest

ON_CPU = {"UNIDIST_DEVICE": "cpu"}
K = 0x9E3779B97F4A7C15


def reference(t: torch.Tensor, chunk: int) -> int:
    """The digest by its definition, word by word in Python integers."""
    data = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
    data += bytes(-len(data) % 8)
    total = 0
    for q in range(len(data) // 8):
        word = int.from_bytes(data[8 * q:8 * q + 8], "little")
        total += word * (2 * K * (q % chunk) + 1) * (2 * K * (q // chunk) + 1)
    return total % (1 << 64)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.int8, torch.int64,
          torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_is_its_definition_and_any_split_adds_up(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "CHUNK", 64)  # several weight tables inside 1001 elements
    monkeypatch.setattr(digest, "_table", [])
    torch.manual_seed(0)
    t = torch.rand(1001) > 0.5 if dtype == torch.bool else (torch.randn(1001) * 1e4).to(dtype)
    whole = digest.of_slice(t, 0)
    assert whole == reference(t, 64)
    for cuts in ([0, 1, 2, 3, 700, 1001], [0, 333, 1001], [0, 999, 1001]):
        parts = sum(digest.of_slice(t[a:b], a) for a, b in itertools.pairwise(cuts))
        assert parts % (1 << 64) == whole


def test_digest_sees_one_bit_and_one_swap() -> None:
    torch.manual_seed(1)
    t = torch.randn(3_000_001)  # past one weight table (2**20 words)
    whole = digest.of_slice(t, 0)
    flipped = t.clone()
    flipped[2_999_999] = torch.nextafter(flipped[2_999_999], torch.tensor(float("inf")))
    swapped = t.clone()
    swapped[7], swapped[8] = t[8], t[7]
    assert digest.of_slice(flipped, 0) != whole and digest.of_slice(swapped, 0) != whole


@pytest.fixture
def mgr() -> unidist.Manager:
    with unidist.init(environ=ON_CPU) as m:
        yield m


def saved(mgr: unidist.Manager, path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    mgr.backward(model(torch.ones(3, 5)).pow(2).sum())
    opt.step()
    return mgr.save_checkpoint(path, model, opt, step=1), model


def fresh(mgr: unidist.Manager) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    return mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))


def test_manifest_stamps_digests_and_writer(mgr: unidist.Manager, tmp_path: Path) -> None:
    path, model = saved(mgr, tmp_path / "ck")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == 2
    assert manifest["writer"] == {"unidist": unidist.__version__, "torch": torch.__version__}
    w = model.state_dict()["0.weight"]
    assert manifest["digests"]["model"]["0.weight"] == f"{digest.of_slice(w.reshape(-1), 0):016x}"
    assert set(manifest["digests"]["optim"]["2.bias"]) == {"exp_avg", "exp_avg_sq"}


def _rewrite_shard(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Alter a tensor in the shard and give the file a valid size and checksum in the manifest, as a tool that
    rewrote it would."""
    shard = path / "shard-00000-of-00001.pt"
    data = torch.load(shard, weights_only=True)
    change(data)
    buf = io.BytesIO()
    torch.save(data, buf)
    shard.write_bytes(buf.getvalue())
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["files"][0]
    entry["bytes"], entry["sha256"] = len(buf.getvalue()), hashlib.sha256(buf.getvalue()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("where", "named"), [(("model", "2.weight"), "model '2.weight'"),
                                              (("optim", "0.bias", "exp_avg_sq"),
                                               "optimizer state 'exp_avg_sq' of '0.bias'")])
def test_a_tensor_altered_behind_a_valid_checksum_is_caught(mgr: unidist.Manager, tmp_path: Path,
                                                            where: tuple[str, ...], named: str) -> None:
    path, _ = saved(mgr, tmp_path / "ck")

    def change(data: dict) -> None:  # type: ignore[type-arg]
        node = data[where[0]][where[1]]
        flat = (node if len(where) == 2 else node[where[2]])[1]
        flat[-1] += 1e-3  # one element, a realistic silent corruption

    _rewrite_shard(path, change)
    model, opt = fresh(mgr)
    with pytest.raises(CheckpointMismatchError, match=f"after the load, {named}"):
        mgr.load_checkpoint(path, model, opt)


def test_a_load_that_agrees_passes_the_check(mgr: unidist.Manager, tmp_path: Path) -> None:
    path, model = saved(mgr, tmp_path / "ck")
    other, opt = fresh(mgr)
    assert mgr.load_checkpoint(path, other, opt) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(),
                                                 strict=True))
    assert opt.state_dict()["state"][0]["step"] == 1


def test_a_changed_step_is_caught(mgr: unidist.Manager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer's scalars are compared after the load too: a layout that dropped Adam's step is named."""
    path, _ = saved(mgr, tmp_path / "ck")
    model, opt = fresh(mgr)
    real = torch.optim.Adam.load_state_dict

    def lossy(self: torch.optim.Optimizer, state: dict) -> None:  # type: ignore[type-arg]
        for st in state["state"].values():
            st["step"] = torch.tensor(0.0)
        real(self, state)

    monkeypatch.setattr(torch.optim.Adam, "load_state_dict", lossy)
    with pytest.raises(CheckpointMismatchError, match="optimizer scalar 'step'"):
        mgr.load_checkpoint(path, model, opt)


def test_format_one_still_loads_and_a_newer_format_is_refused(mgr: unidist.Manager, tmp_path: Path) -> None:
    path, _ = saved(mgr, tmp_path / "ck")
    manifest = json.loads((path / "manifest.json").read_text())
    old = {k: v for k, v in manifest.items() if k not in ("digests", "writer")}
    old["files"] = [{k: v for k, v in f.items() if k != "digests"} for f in manifest["files"]]
    (path / "manifest.json").write_text(json.dumps({**old, "version": 1}))
    model, opt = fresh(mgr)
    assert mgr.load_checkpoint(path, model, opt) == {"step": 1}
    (path / "manifest.json").write_text(json.dumps({**manifest, "version": 3,
                                                    "writer": {"unidist": "9.0", "torch": "3.1"}}))
    with pytest.raises(CheckpointError, match=r"format version 3 \(written by unidist 9.0, torch 3.1\); this "
                                              r"unidist \(.*\) reads versions 1-2"):
        mgr.load_checkpoint(path, model, opt)
