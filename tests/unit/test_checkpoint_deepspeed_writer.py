"""``save_checkpoint(format="deepspeed")`` on one process: DeepSpeed's files, with the keys of the files real DeepSpeed
0.19.8 wrote (tests/data/deepspeed_written), holding exactly the optimizer's state, read back by unidist at every
ZeRO stage. Real DeepSpeed resuming them at two ranks: tests/multiproc/test_ds_interop.py."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import require
from workers.ckpt_interop_model import VOCAB, build

import unidist
from unidist.checkpoint.deepspeed_files import DeepSpeedFiles
from unidist.checkpoint.deepspeed_writer import _sub_groups, unsupported
from unidist.errors import InvalidArgumentError

REAL = Path(__file__).resolve().parents[1] / "data" / "deepspeed_written"
# what DeepSpeed writes that this writer leaves out: its loss-scaler object and fragment addresses (ZeRO 1-2: a stage
# 1-2 load keeps the engine's own when absent; ds_to_universal would need the addresses)
LEFT_OUT = {"loss_scaler", "param_slice_mappings"}


@pytest.fixture
def mgr() -> Iterator[unidist.Manager]:
    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as m:
        yield m


def _trained(mgr: unidist.Manager, stage: int, precision: str = "32") -> tuple[Any, Any]:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = mgr.prepare(model, opt, zero_stage=stage, precision=precision, clip_grad_norm=1.0)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, VOCAB, (6, 5), generator=g), torch.randn(6, 5, VOCAB, generator=g) * 10
        mgr.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    return model, opt


def _keys(obj: Any, depth: int = 2) -> set[str]:
    """Dict keys down to ``depth`` levels, as paths (a file's structure without its values)."""
    out: set[str] = set()
    if isinstance(obj, dict) and depth:
        for k, v in obj.items():
            out.add(str(k))
            out |= {f"{k}/{sub}" for sub in _keys(v, depth - 1)} if isinstance(v, dict) else set()
    return out


def _saved(mgr: unidist.Manager, path: Path, stage: int, precision: str) -> tuple[Any, Any, Path]:
    """A model trained 3 steps at ``stage`` and saved in DeepSpeed's format, read back exactly; then loaded at
    another stage."""
    model, opt = _trained(mgr, stage, precision)
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if "bf16" in precision:
        config["bf16"] = {"enabled": True}
    head = {"global_steps": 3, "global_samples": 18, "ds_config": config}
    path = mgr.save_checkpoint(path, model, opt, format="deepspeed", deepspeed=head, note="n")
    files = DeepSpeedFiles(path)
    assert (files.stage, files.world, files.extra()["note"]) == (stage, 1, "n")
    assert files.extra()["deepspeed"]["global_steps"] == 3
    assert files.shared == {"head.weight": "emb.weight"}  # the tie (named at stages 1-3, by storage at 0)
    full = mgr.full_optimizer_state_dict(opt)["state"]
    named = dict(mgr.unwrap(model).named_parameters())
    for i, (name, q) in enumerate(named.items()):
        n = int(torch.Size(files.shapes[name]).numel())
        assert torch.equal(files.read("model", name, "", 0, n), opt.full_param(q).float().reshape(-1)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(files.read("optim", name, key, 0, n), full[i][key].float().reshape(-1)), (name, key)
    fresh, fresh_opt = _trained(mgr, 3 - stage if stage != 3 else 1, precision)  # another stage reads them
    mgr.load_checkpoint(path, fresh, fresh_opt)
    for (name, q), r in zip(named.items(), mgr.unwrap(fresh).parameters(), strict=True):
        assert torch.equal(opt.full_param(q), fresh_opt.full_param(r)), name
    return model, opt, path


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_written_files_hold_the_state(mgr: unidist.Manager, tmp_path: Path, stage: int) -> None:
    _saved(mgr, tmp_path / "global_step3", stage, "32")


@pytest.mark.deepspeed
@pytest.mark.parametrize(("stage", "precision", "real"), [(2, "32", "2-fp32"), (3, "bf16-master", "3-bf16")])
def test_written_files_carry_deepspeeds_keys(mgr: unidist.Manager, tmp_path: Path, stage: int, precision: str,
                                             real: str) -> None:
    """Beside what real DeepSpeed wrote at the same stage (its files hold its own classes: DeepSpeed installed);
    ZeRO 3 needs DeepSpeed's LossScaler too."""
    require("deepspeed")
    _, _, path = _saved(mgr, tmp_path / "global_step3", stage, precision)
    theirs = {p.name: p for p in (REAL / real / "global_step3").iterdir()}  # (two ranks wrote these)
    assert {p.name for p in path.iterdir()} <= set(theirs), sorted(p.name for p in path.iterdir())
    for m in sorted(path.iterdir()):
        got, want = torch.load(m, weights_only=False), torch.load(theirs[m.name], weights_only=False)
        # (the configs differ, and each file's client state is its own: "step" there, "note" here)
        ours, real_keys = (_keys(x) - {"step", "note", "unidist.rng"} for x in (got, want))
        ours, real_keys = ({k for k in keys if not k.startswith("ds_config/")} for keys in (ours, real_keys))
        assert {k for k in real_keys - ours if k.split("/")[-1] not in LEFT_OUT} == set(), m.name
        assert ours - real_keys == set(), m.name


def test_sub_groups_are_deepspeeds() -> None:
    """ZeRO-3's sub-groups (``_create_fp16_sub_groups``): the whole group when it fits, else runs closed once they
    reach ``sub_group_size`` elements per rank, the last one with whatever is left."""
    parts = {"a": 5, "b": 3, "c": 4, "d": 7}
    assert _sub_groups(list(parts), parts, 100) == [list(parts)]
    assert _sub_groups(list(parts), parts, 6) == [["a", "b"], ["c", "d"]]
    assert _sub_groups(list(parts), parts, 5) == [["a"], ["b", "c"], ["d"]]


def test_what_is_not_written_says_why(mgr: unidist.Manager, tmp_path: Path) -> None:
    assert "16-bit model at ZeRO stage 0" in str(unsupported(0, torch.bfloat16))
    if importlib.util.find_spec("deepspeed") is None:
        assert "install deepspeed" in str(unsupported(3, torch.float32))
    else:
        assert "dynamic loss scale" in str(unsupported(3, torch.float16, {"fp16": {"enabled": True}}))
        assert unsupported(3, torch.float16, {"fp16": {"enabled": True, "loss_scale": 128}}) is None
    model, opt = _trained(mgr, 0, "bf16-master")
    with pytest.raises(InvalidArgumentError, match="16-bit model at ZeRO stage 0"):
        mgr.save_checkpoint(tmp_path / "x", model, opt, format="deepspeed")
    with pytest.raises(InvalidArgumentError, match="keep= and blocking=False"):
        mgr.save_checkpoint(tmp_path / "x", model, opt, format="deepspeed", keep=2)
    assert not (tmp_path / "x").exists()
