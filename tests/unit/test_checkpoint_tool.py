"""``unidist checkpoint inspect`` and ``export`` on one process: what inspect says and when it fails, and exported
files read back by independent readers (safetensors' own ``load_file``, ``torch.load``) equal to the model.

Exports of checkpoints that real launches wrote (every backend, ZeRO 0-3, the model zoo) are checked in
tests/workers/model_zoo.py (``roundtrip``'s ``export``)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unidist
from unidist.checkpoint import tool
from unidist.cli import main

ON_CPU = {"UNIDIST_DEVICE": "cpu"}


class Tied(torch.nn.Module):
    """An embedding tied to the output layer (GPT-2's wte/lm_head), a buffer, and bfloat16 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("count", torch.arange(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x))  # type: ignore[no-any-return]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    with unidist.init(environ=ON_CPU) as mgr:
        torch.manual_seed(0)
        model = Tied().to(torch.bfloat16)
        model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        mgr.backward(model(torch.arange(5)).float().pow(2).sum())
        opt.step()
        path = mgr.save_checkpoint(tmp_path / "ck", model, opt, step=1)
        return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_inspect_says_what_it_holds(saved: tuple[Path, dict[str, torch.Tensor]],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = saved
    assert main(["checkpoint", "inspect", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}: a unidist checkpoint (format 2), written by unidist {unidist.__version__} "
                             f"with torch {torch.__version__} on ")
    assert out[1] == "saved by 1 rank(s) on the local backend at ZeRO stage 0"
    # the tied weight under both names (as the model's state dict has it), the buffer's int64
    assert out[2] == "model: 3 tensors, 135 elements, 288 B (bfloat16, int64)"
    assert out[3] == "optimizer: AdamW over 1 parameters; per-element state exp_avg, exp_avg_sq"
    assert "check digests: 5 tensors, each adds up to its digest" in out
    assert any(line.startswith("  out.weight  [11, 6]  bfloat16  ") for line in out)


def _alter(path: Path) -> None:
    """One element of the embedding changed, the shard's size and sha256 in the manifest made valid again."""
    shard = path / "shard-00000-of-00001.pt"
    data = torch.load(shard, weights_only=True)
    data["model"]["emb.weight"][1][3] += 1
    buf = io.BytesIO()
    torch.save(data, buf)
    shard.write_bytes(buf.getvalue())
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][0].update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_inspect_fails_on_a_tensor_altered_behind_its_checksum(saved: tuple[Path, dict[str, torch.Tensor]],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = saved
    _alter(path)
    assert main(["checkpoint", "inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED shard-00000-of-00001.pt: its tensors' digest terms differ from the manifest's" in out
    assert "FAILED digests: 1 of 5 differ: model 'emb.weight'" in out


def test_inspect_fails_on_a_truncated_file(saved: tuple[Path, dict[str, torch.Tensor]],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = saved
    shard = path / "shard-00000-of-00001.pt"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["checkpoint", "inspect", str(path)]) == 1
    assert "FAILED shard-00000-of-00001.pt: 100 bytes, sha256 " in capsys.readouterr().out
    assert size != 100


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_equals_the_model(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, suffix: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path, state = saved
    out = tmp_path / f"model{suffix}"
    assert main(["checkpoint", "export", str(path), str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 3 tensors, ")
    got = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    assert sorted(got) == sorted(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", out.name])  # no scratch or temporary left


def test_export_reports_progress_per_tensor(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, _ = saved
    seen: list[tuple[int, int, str]] = []
    tool.export(tool.Opened(path), tmp_path / "m.safetensors", progress=lambda *a: seen.append(a))
    assert seen == [(1, 3, "count"), (2, 3, "emb.weight"), (3, 3, "out.weight")]  # the state dict's order


@pytest.mark.parametrize(("args", "says"), [
    (["export", "{ck}", "{tmp}/model.bin"], "must end in .safetensors or .pt"),
    (["inspect", "{tmp}"], "is neither a unidist checkpoint (no manifest.json) nor a DeepSpeed one"),
    (["inspect", "{tmp}/nothing"], "is not a complete unidist checkpoint"),
    (["inspect", "{ck}", "--part", "3"], "--part 3: "),
])
def test_bad_input_is_exit_2_with_the_fix(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    path, _ = saved
    argv = ["checkpoint", *(a.format(ck=path, tmp=tmp_path) for a in args)]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "model.bin").exists()


def test_a_checkpoint_of_several_parts_needs_part(saved: tuple[Path, dict[str, torch.Tensor]],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = saved
    manifest = json.loads((path / "manifest.json").read_text())
    part = {k: manifest[k] for k in ("state", "state_keys", "digests")}
    manifest["parts"] = [{"ranks": [0], **part}, {"ranks": [1], **part}]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert main(["checkpoint", "inspect", str(path)]) == 2
    assert "holds 2 data-parallel parts" in capsys.readouterr().err
    assert main(["checkpoint", "inspect", str(path), "--part", "0"]) == 0
