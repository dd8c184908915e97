"""``save_checkpoint(..., format="deepspeed")``: the files real DeepSpeed's ``engine.load_checkpoint`` resumes from,
written from any engine at the world size and ZeRO stage the DeepSpeed run will have, so a job trained through
unidist (``unidist.compat.deepspeed`` off DeepSpeed, say) can go back to DeepSpeed.

DeepSpeed keeps its ZeRO optimizer's state in its own layout (deepspeed_files.py reads it; this module writes the
same): stages 1-2 flatten each param group's trainable parameters into one vector, pad it to a multiple of twice
the data-parallel size and cut it into equal partitions, one per rank; stage 3 cuts every parameter on its own into
``ceil(numel / world)`` elements per rank and concatenates a rank's pieces per sub-group; stage 0 keeps the torch
optimizer's state dict whole. Each rank writes its own partition file (``[bf16_]zero_pp_rank_R_mp_rank_00_optim_
states.pt``: the float32 master partition and the optimizer's state over it, as DeepSpeed's base optimizer holds it)
and rank 0 the model-states file (the module's state dict, parameter shapes, tied names, the engine's counters, the
scheduler, the config, and the script's ``client_state`` at the top level, where DeepSpeed returns it from).

What a rank's partition holds is assembled one full tensor at a time (its pieces gathered from whichever ranks
hold them, then sliced): a rank keeps its partition and one tensor, never the model's whole state. The files are
written under a temporary name and renamed when every rank's are complete.

Not written (``unsupported`` says why, and the caller keeps unidist's format): a 16-bit model at stage 0 (DeepSpeed
wraps it in its FP16 optimizers, whose files hold its flat groups and loss-scaler objects), a model prepared over
part of the world (tensor or pipeline parallel), and stage 3 without DeepSpeed installed (its files hold
DeepSpeed's loss-scaler object, which only DeepSpeed's class can make).
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from unidist.checkpoint.agree import World, agree_or_discard, temporary_beside
from unidist.checkpoint.files import rename_into_place
from unidist.checkpoint.layout import MASTER, Layout, dtype_named, per_element
from unidist.errors import CheckpointError, InvalidArgumentError

__all__ = ["HEAD_KEY", "save_deepspeed", "unsupported"]

HEAD_KEY = "deepspeed"  # the extra entry with the engine's counters, scheduler and config (deepspeed_files reads it)
FORMAT_VERSION = "0.19.8"  # the DeepSpeed release whose layout this writes, recorded when DeepSpeed is not installed
ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: a ZeRO 1-2 group is padded to ALIGNMENT x world elements
SUB_GROUP_SIZE = 1_000_000_000  # ZeRO-3's default sub_group_size (elements per rank in one flat sub-group)


def unsupported(stage: int, dtype: torch.dtype, config: dict[str, Any] | None = None) -> str | None:
    """Why DeepSpeed's format cannot be written for a run at ZeRO ``stage`` whose weights are ``dtype`` (None: it
    can); ``config``: the run's DeepSpeed config, if it has one."""
    if stage == 0 and dtype != torch.float32:
        return "a 16-bit model at ZeRO stage 0 (DeepSpeed's FP16 optimizers keep their own flat files)"
    if stage == 3 and importlib.util.find_spec("deepspeed") is None:
        return "ZeRO-3's files hold DeepSpeed's loss-scaler object: install deepspeed to write them"
    if stage == 3 and _static_scale(config or {}) is None:
        return "fp16's dynamic loss scale at ZeRO-3 (DeepSpeed's DynamicLossScaler object holds its state)"
    return None


def save_deepspeed(mgr: World, path: str | os.PathLike[str], layout: Layout, module: torch.nn.Module,
                   extra: dict[str, Any], first_names: dict[str, str],
                   allgather: Callable[[torch.Tensor], torch.Tensor]) -> Path:
    """Write DeepSpeed's checkpoint (a tag directory) of ``layout``'s state; every rank calls it.

    Args:
        mgr: the world. path: the tag directory (``<save_dir>/global_step{N}``).
        layout: the prepared optimizer's layout (its ``zero_stage`` is the stage written).
        module: the user's model (its state dict, which parameters train, and tied names).
        extra: ``HEAD_KEY`` (optional): ``global_steps``, ``global_samples``, ``skipped_steps``, ``lr_scheduler``,
            ``ds_config``; every other entry goes to the top level, DeepSpeed's ``client_state``.
        first_names: each of the layout's parameter names as the module's ``named_parameters`` gives it first.
        allgather: the world's allgather (``Manager.allgather``: every rank's rows concatenated, first dims may
            differ), by which each rank gets the full tensors its partition needs.
    """
    dtypes = sorted({layout.shapes[n][1] for n in layout.opt_names if n in layout.shapes})
    why = ("the model is prepared over part of the world (tensor or pipeline parallel)" if layout.size != mgr.size
           else "there is no optimizer (DeepSpeed's files hold its state)" if layout.optimizer is None
           else f"its weights are of several dtypes ({', '.join(dtypes)})" if len(dtypes) > 1
           else unsupported(layout.zero_stage, dtype_named(dtypes[0]) if dtypes else torch.float32,
                            (extra.get(HEAD_KEY) or {}).get("ds_config")))
    if why is not None:
        raise InvalidArgumentError(f"save_checkpoint(format='deepspeed') cannot write {path}: {why}")
    final = Path(path).absolute()
    tmp = temporary_beside(mgr, final)
    problem: BaseException | None = None
    try:
        files = _files(mgr, layout, module, dict(extra), first_names, _Gather(allgather))
        for name, obj in files.items():
            with open(tmp / name, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
    except (OSError, CheckpointError) as err:
        problem = CheckpointError(f"rank {mgr.rank} cannot write {tmp}: {err}")
    agree_or_discard(mgr, problem, tmp)
    try:
        if mgr.rank == 0:
            rename_into_place(tmp, final)
    except OSError as err:
        problem = CheckpointError(f"cannot publish {final}: {err}")
    agree_or_discard(mgr, problem, tmp)
    return final


def _version() -> str:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return FORMAT_VERSION


def _files(mgr: World, layout: Layout, module: torch.nn.Module, extra: dict[str, Any], first_names: dict[str, str],
           gather: _Gather) -> dict[str, Any]:
    """This rank's files: {file name: object to torch.save}."""
    head = dict(extra.pop(HEAD_KEY, None) or {})
    stage, rank, world = layout.zero_stage, mgr.rank, mgr.size
    params = dict(module.named_parameters())
    names = [first_names.get(n, n) for n in layout.opt_names]
    trainable = [(n, g) for n, g in zip(names, layout.opt_groups, strict=True) if params[n].requires_grad]
    groups = [[n for n, g in trainable if g == gi] for gi in range(len(layout.optimizer.param_groups))]
    frozen = [n for n, p in params.items() if not p.requires_grad]
    own = next(iter(params.values())).dtype if params else torch.float32
    config = dict(head.get("ds_config") or _config(stage, own))
    version = _version()
    # DeepSpeed's weights dtype: its config's (an fp16 run trained here in float32 with autocast is saved as
    # DeepSpeed's fp16 engine holds it), else the module's
    dtype = _config_dtype(config) or own
    # the full shapes (ZeRO-3 leaves placeholders in the module), by the module's names
    shapes = {first_names.get(n, n): torch.Size(s) for n, (s, _) in layout.shapes.items()}
    states = _model_states(module, layout, shapes, groups, frozen, head, config, version, world, extra, dtype)
    out: dict[str, Any] = {}
    if stage == 0:
        if rank == 0:
            states["optimizer"] = layout.optimizer.state_dict()
            out["mp_rank_00_model_states.pt"] = states
        return out
    prefix = "bf16_" if dtype == torch.bfloat16 else ""
    optim_file = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    pieces = layout.pieces(copy=False)  # a collective on DeepSpeed engines: every rank, in the same order
    by_layout = {first_names.get(n, n): n for n in layout.opt_names}
    meta = layout.meta()
    # each parameter's state keys as the ranks holding a piece of it see them: every rank then gathers the same
    # tensors in the same order (a rank may hold nothing of a small parameter)
    keys: dict[str, set[str]] = {}
    for seen in mgr.allgather_object({n: sorted(k for k in st if k != MASTER) for n, st in pieces["optim"].items()}):
        for n, ks in seen.items():
            keys.setdefault(n, set()).update(ks)
    source = _Source(pieces, by_layout, meta, {n: tuple(s) for n, (s, _) in layout.shapes.items()}, gather,
                     {n: sorted(ks) for n, ks in keys.items()})
    settings = meta["param_groups"]
    if stage in (1, 2):
        body = _zero12(source, groups, settings, rank, world, stage)
        if rank == 0:
            out["mp_rank_00_model_states.pt"] = states
    else:
        sub_size = int((config.get("zero_optimization") or {}).get("sub_group_size", SUB_GROUP_SIZE))
        body = _zero3(source, groups, settings, rank, world, sub_size, _static_scale(config))
        every = {n for n, _ in module.named_parameters(remove_duplicate=False)}  # a tied weight's other names too
        states["module"] = OrderedDict((k, torch.empty(0, dtype=v.dtype) if k in every else v)
                                       for k, v in states["module"].items())
        states["frozen_param_fragments"] = OrderedDict(
            (n, _slice3(source.full_model(n, shapes[n].numel(), params[n].dtype), rank, world)) for n in frozen)
        out[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = states
    if stage in (1, 2):  # (stage 3's state dict has neither)
        body.update({"ds_version": version, "clip_grad": float(config.get("gradient_clipping", 0.0) or 0.0)})
    out[optim_file] = {"optimizer_state_dict": body, "ds_config": config, "ds_version": version}
    return out


def _config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The weights dtype a DeepSpeed config gives its engine (None: float32, or no 16-bit section)."""
    if (config.get("fp16") or {}).get("enabled"):
        return torch.float16
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    return None


def _config(stage: int, dtype: torch.dtype) -> dict[str, Any]:
    """A minimal config saying what DeepSpeed would need to know (the caller's own config replaces it)."""
    out: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if dtype == torch.bfloat16:
        out["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        out["fp16"] = {"enabled": True}
    return out


def _model_states(module: torch.nn.Module, layout: Layout, shapes: dict[str, torch.Size], groups: list[list[str]],
                  frozen: list[str], head: dict[str, Any], config: dict[str, Any], version: str, world: int,
                  extra: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The model-states file's dict, as DeepSpeed's ``_common_checkpoint_state`` builds it (stages 0-2 on rank 0;
    at stage 3 each rank's, with the module's parameters empty)."""
    params = dict(module.named_parameters())
    every = dict(module.named_parameters(remove_duplicate=False))
    buffers = [n for n, b in module.named_buffers() if b is not None]
    # tied entries stay one tensor in the file (as DeepSpeed's torch.save of the module keeps them): readers find
    # the tie by storage; written in the foreground, so CPU tensors need no copy
    # the parameters in DeepSpeed's weights dtype (its engine casts them, not the buffers)
    on_cpu: dict[int, torch.Tensor] = {}
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    sd = OrderedDict((k, on_cpu.setdefault(v.data_ptr(), v.detach().to("cpu", dtype if k in names and
                                                                         v.is_floating_point() else v.dtype)))
                     for k, v in module.state_dict().items())
    zero = layout.zero_stage > 0
    first = {id(p): n for n, p in params.items()}
    steps = int(head.get("global_steps", 0))
    states: dict[str, Any] = {
        "module": sd, "buffer_names": [b for b in buffers if b in sd], "optimizer": None,
        "param_shapes": [OrderedDict((n, shapes[n]) for n in g) for g in groups] if zero else None,
        "frozen_param_shapes": OrderedDict((n, shapes[n]) for n in frozen) if layout.zero_stage >= 2 else None,
        "shared_params": {n: first[id(p)] for n, p in every.items() if first[id(p)] != n} if zero else None,
        "frozen_param_fragments": OrderedDict((n, params[n].detach().cpu()) for n in frozen)
        if layout.zero_stage == 2 else None,
        "lr_scheduler": head.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
        "skipped_steps": int(head.get("skipped_steps", 0)), "global_steps": steps,
        "global_samples": int(head.get("global_samples", 0)), "dp_world_size": world, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": config, "ds_version": version,
    }
    clash = sorted(set(extra) & set(states))
    if clash:
        raise InvalidArgumentError(f"save_checkpoint(format='deepspeed'): {clash} are DeepSpeed's own keys in its "
                                   "model-states file; name the client state's entries otherwise")
    states.update(extra)  # DeepSpeed's client_state: top-level keys
    return states


class _Gather:
    """A full tensor from the pieces the ranks hold: every rank sends (start, length) and its piece's bytes (two
    allgathers; bytes, so that any dtype travels on any engine bit for bit) and places every piece."""

    def __init__(self, allgather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.allgather = allgather

    def __call__(self, piece: tuple[int, torch.Tensor] | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start, flat = piece if piece is not None else (0, torch.empty(0, dtype=dtype))
        flat = flat.detach().reshape(-1).to("cpu", dtype)
        heads = self.allgather(torch.tensor([[start, flat.numel()]], dtype=torch.int64)).tolist()
        data = self.allgather(flat.contiguous().view(torch.uint8)) if any(n for _, n in heads) \
            else torch.empty(0, dtype=torch.uint8)  # (heads are every rank's: all skip together)
        out = torch.zeros(numel, dtype=dtype)
        width, at = torch.empty(0, dtype=dtype).element_size(), 0
        for s, n in heads:
            out[s:s + n] = data[at:at + n * width].view(dtype)
            at += n * width
        return out


class _Source:
    """Full float32 masters and optimizer states of parameters, by the module's name, gathered on every rank."""

    def __init__(self, pieces: dict[str, Any], by_layout: dict[str, str], meta: dict[str, Any],
                 shapes: dict[str, tuple[int, ...]], gather: _Gather, keys: dict[str, list[str]]) -> None:
        self.pieces, self.by_layout, self.meta, self.shapes, self.gather = pieces, by_layout, meta, shapes, gather
        self._keys = keys

    def numel(self, name: str) -> int:
        return int(torch.Size(self.shapes[self.by_layout[name]]).numel())

    def keys(self, name: str) -> list[str]:
        """The per-element optimizer state keys of ``name`` (every rank's view, united)."""
        return self._keys.get(self.by_layout[name], [])

    def scalars(self, name: str) -> dict[str, Any]:
        return dict(self.meta["scalars"].get(self.by_layout[name], {}))

    def master(self, name: str) -> torch.Tensor:
        """The float32 weight the optimizer steps (a 16-bit weight's master copy, else the weight)."""
        own = self.by_layout[name]
        st = self.pieces["optim"].get(own, {})
        piece = st.get(MASTER, self.pieces["model"].get(own))
        return self.gather(piece, self.numel(name), torch.float32)

    def state(self, name: str, key: str, dtype: torch.dtype) -> torch.Tensor:
        return self.gather(self.pieces["optim"].get(self.by_layout[name], {}).get(key), self.numel(name), dtype)

    def full_model(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.gather(self.pieces["model"].get(self.by_layout.get(name, name)), numel, dtype)


def _zero12(source: _Source, groups: list[list[str]], settings: list[dict[str, Any]], rank: int, world: int,
            stage: int) -> dict[str, Any]:
    """This rank's ZeRO 1-2 optimizer state: each group's partition ``rank`` of its flat vector."""
    state: dict[int, dict[str, Any]] = {}
    singles, paddings = [], []
    for gi, names in enumerate(groups):
        total = sum(source.numel(n) for n in names)
        padded = -(-total // (ALIGNMENT * world)) * ALIGNMENT * world
        size = padded // world
        lo = rank * size
        paddings.append(size if total <= lo else max(0, lo + size - total))
        keys = source.keys(names[0]) if names else []
        master = torch.zeros(size, dtype=torch.float32)
        parts = {k: torch.zeros(size, dtype=torch.float32) for k in keys}
        at = 0
        for n in names:
            m = source.numel(n)
            a, b = max(at, lo), min(at + m, lo + size)
            full = source.master(n)
            if a < b:
                master[a - lo:b - lo] = full[a - at:b - at]
            for k in keys:
                whole = source.state(n, k, torch.float32)
                if a < b:
                    parts[k][a - lo:b - lo] = whole[a - at:b - at]
            at += m
        singles.append(master[:size - paddings[-1]].clone())
        state[gi] = {**_group_scalars(source, names), **parts}
    return {"base_optimizer_state": {"state": state, "param_groups": [{**s, "params": [gi]}
                                                                      for gi, s in enumerate(settings)]},
            "single_partition_of_fp32_groups": singles, "zero_stage": stage, "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(g) for g in groups], "partition_count": [world] * len(groups),
            "dynamic_loss_scale": False, "overflow": False}


def _group_scalars(source: _Source, names: list[str]) -> dict[str, Any]:
    """The flat partition's scalars (Adam's ``step``): the group's first parameter's (DeepSpeed steps them as one)."""
    if not names:
        return {}
    return {k: v for k, v in source.scalars(names[0]).items() if not per_element(v, (source.numel(names[0]),))}


def _slice3(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s ZeRO-3 piece of a flattened tensor: ``ceil(numel / world)`` elements, zero-padded."""
    flat = full.reshape(-1)
    part = -(-flat.numel() // world)
    out = torch.zeros(part, dtype=flat.dtype)
    piece = flat[rank * part:(rank + 1) * part]
    out[:piece.numel()] = piece
    return out


def _sub_groups(names: list[str], parts: dict[str, int], sub_size: int) -> list[list[str]]:
    """DeepSpeed's ZeRO-3 sub-groups of a param group: the whole group, or runs of at least ``sub_size`` elements
    per rank (``_create_fp16_sub_groups``)."""
    if sub_size >= sum(parts[n] for n in names):
        return [names]
    out, run, size = [], [], 0
    for n in names:
        run.append(n)
        size += parts[n]
        if size >= sub_size or n == names[-1]:
            out.append(run)
            run, size = [], 0
    return out


def _static_scale(config: dict[str, Any]) -> float | None:
    """The loss scale DeepSpeed's stage 3 keeps in its LossScaler: 1.0 (float32, bfloat16) or fp16's fixed
    ``loss_scale``; None for fp16's dynamic scale (its DynamicLossScaler's state is DeepSpeed's own)."""
    fp16 = config.get("fp16") or {}
    if not fp16.get("enabled"):
        return 1.0
    scale = float(fp16.get("loss_scale", 0) or 0)
    return scale or None


def _zero3(source: _Source, groups: list[list[str]], settings: list[dict[str, Any]], rank: int, world: int,
           sub_size: int, scale: float | None) -> dict[str, Any]:
    """This rank's ZeRO-3 optimizer state: per sub-group, its piece of each parameter, one after the other."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # the object DeepSpeed's stage 3 restores as is

    state: dict[int, dict[str, Any]] = {}
    flats, param_groups = [], []
    for gi, names in enumerate(groups):
        parts = {n: -(-source.numel(n) // world) for n in names}
        indices = []
        for run in _sub_groups(names, parts, sub_size) if names else []:
            keys = source.keys(run[0])
            flats.append(torch.cat([_slice3(source.master(n), rank, world) for n in run]))
            per = {k: torch.cat([_slice3(source.state(n, k, torch.float32), rank, world) for n in run])
                   for k in keys}
            indices.append(len(state))
            state[len(state)] = {**_group_scalars(source, run), **per}
        param_groups.append({**settings[gi], "params": indices})
    return {"zero_stage": 3, "loss_scaler": LossScaler(scale=scale), "dynamic_loss_scale": False, "overflow": False,
            "partition_count": world, "optimizer_state_dict": {"state": state, "param_groups": param_groups},
            "fp32_flat_groups": flats}
