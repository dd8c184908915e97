"""DeepSpeed's checkpoint files, read without DeepSpeed: any slice of any full tensor a real ``engine.save_checkpoint``
wrote (ZeRO stages 0-3, float32, bfloat16 or float16 weights), for a load onto any engine, world size and stage.

A DeepSpeed checkpoint is a tag directory (``global_step{N}``; its parent's ``latest`` file names the newest) holding
``mp_rank_00_model_states.pt`` (stages 0-2: the module's state dict, at stage 0 also the optimizer; at 1-2 each
parameter group's names and shapes, ``param_shapes``) or, at stage 3, one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
per rank, and at stages 1-3 one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank with that rank's
partition of the float32 master weights and of the optimizer state. Where an element lives (what DeepSpeed's own
``zero_to_fp32`` script reconstructs, read here one slice at a time):

- stages 1-2: each parameter group is one flat vector, its parameters in ``param_shapes`` order (each followed by
  its ``param_alignment_paddings``), cut into ``partition_count`` equal partitions; rank R's file holds partition R
  (``single_partition_of_fp32_groups``, the last without its padding; the optimizer state with it);
- stage 3: every parameter is cut on its own into ``ceil(numel / world)`` elements per rank, and rank R's flat
  groups hold its piece of each parameter, in ``param_shapes`` order, one after the other;
- stage 0: the module and the torch optimizer's state whole (a half-precision model's float32 copies in the
  optimizer's ``fp32_groups``); DeepSpeed records no parameter names there: the optimizer's parameters are the
  model's in state-dict order, checked by count and shape.

Files are memory-mapped and read where a slice is asked for, so a rank reads the partitions holding its part, not
the model. DeepSpeed's own classes in its files (its loss scaler, ZeRO's stage enum, fragment addresses) are read
as plain stand-ins under ``torch.load(weights_only=True)``: nothing else is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from unidist.checkpoint.layout import MASTER
from unidist.errors import CheckpointCorruptError, CheckpointError

__all__ = ["DEEPSPEED_KEY", "DeepSpeedFiles", "find"]

LATEST = "latest"
DEEPSPEED_KEY = "deepspeed"  # the load's extra entry holding DeepSpeed's engine counters and scheduler state
# DeepSpeed's optimizer "type" -> the optimizer classes whose state it holds (a class not listed is refused)
FAMILIES = {"adam": {"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"}, "adamw": {"Adam", "AdamW", "FusedAdam",
            "DeepSpeedCPUAdam"}, "sgd": {"SGD"}, "adagrad": {"Adagrad", "DeepSpeedCPUAdagrad"},
            "lamb": {"FusedLamb", "Lamb"}}
HEAD = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stages 0-2, stage 3
# DeepSpeed's own keys in the model-states file; every other top-level key is the script's client_state
OWN = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
       "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
       "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
       "ds_version", "checkpoint_parallel_dimensions", "ds_mp_world_size"}


class _Plain:
    """A DeepSpeed object in its files (LossScaler, fragment_address), read as its attributes only."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _value(v: Any) -> Any:
    """ZeRO's stage enum, read as its number."""
    return v


SAFE: list[Any] = [(_Plain, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        (_Plain, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
        (_Plain, "deepspeed.utils.tensor_fragment.fragment_address"),
        (_value, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def _load(file: Path) -> Any:
    try:
        with torch.serialization.safe_globals(SAFE):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        hint = ("; if it is your client_state's, make it plain data (numbers, strings, lists, dicts, tensors) or "
                "allow the class with torch.serialization.add_safe_globals") if "global" in str(err).lower() else ""
        raise CheckpointCorruptError(f"{file} cannot be read with torch.load(weights_only=True): "
                                     f"{type(err).__name__}: {str(err).splitlines()[0]}{hint}") from err


def find(path: Path) -> Path | None:
    """The tag directory if ``path`` is a DeepSpeed checkpoint (a tag directory, or its parent with ``latest``)."""
    tag_dir = path
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"{path / LATEST} names the tag {tag!r}, but {tag_dir} does not exist: pass the "
                                  "tag directory you want")
    return tag_dir if any((tag_dir / name).is_file() for name in HEAD) else None


class DeepSpeedFiles:
    """One DeepSpeed checkpoint's tensors by name, as slices of the full tensors."""

    def __init__(self, tag_dir: Path) -> None:
        self.dir = tag_dir
        if (tag_dir / "layer_00-model_states.pt").is_file() or (tag_dir / "mp_rank_01_model_states.pt").is_file():
            raise CheckpointError(f"{tag_dir} is a DeepSpeed pipeline- or tensor-parallel checkpoint "
                                  "(layer_*/mp_rank_01 files): only data-parallel ones (ZeRO 0-3) are read; convert "
                                  "it with DeepSpeed's ds_to_universal and zero_to_fp32 scripts first")
        self.stage3 = (tag_dir / HEAD[1]).is_file()
        self.head: dict[str, Any] = _load(tag_dir / HEAD[1 if self.stage3 else 0])
        self.world = int(self.head.get("dp_world_size") or 1)
        prefix = next((p for p in ("bf16_", "")
                       if (tag_dir / f"{p}zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()), None)
        self._optim_names = None if prefix is None else [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                                         for r in range(self.world)]
        self._files: dict[str, Any] = {}
        module: dict[str, torch.Tensor] = self.head.get("module") or {}
        self.buffers = [n for n in self.head.get("buffer_names") or [] if n in module]
        self.shared: dict[str, str] = dict(self.head.get("shared_params") or {})
        self.module = module
        if self._optim_names is None:
            self.stage = 0
            self._stage0()
        else:
            # every rank's files opened (memory-mapped: the pickles read, the tensors not) before anything is loaded,
            # so a missing or truncated one is an error before the model changes
            for r in range(self.world):
                self._optim(r)
                if self.stage3:
                    self._model3(r)
            first = self._optim(0)
            self.stage = 3 if self.stage3 else int(first.get("zero_stage", 2))
            self._zero(first)

    # ---------------------------------------------------------------------------------------------- layout
    def _stage0(self) -> None:
        opt = self.head.get("optimizer")
        unique: dict[int, str] = {}
        for name, t in self.module.items():
            if name not in self.buffers:
                unique.setdefault(_address(t), name)
        self.params = list(unique.values())  # tied entries once, as the optimizer holds them
        self.shared = {n: unique[_address(t)] for n, t in self.module.items()
                       if n not in self.buffers and n not in self.params}
        self.shapes = {n: tuple(self.module[n].shape) for n in self.params}
        self.frozen: dict[str, tuple[int, ...]] = {}
        self.masters: dict[str, torch.Tensor] = {}
        self.inner: dict[str, Any] = {}
        self.groups: list[list[str]] = [self.params]
        if opt is None:
            return
        inner = opt.get("optimizer_state_dict", opt)  # FP16_Optimizer's (bf16/fp16 weights) wraps the torch one
        index = [i for g in inner["param_groups"] for i in g["params"]]
        if len(index) != len(self.params):
            raise CheckpointError(f"{self.dir}: a stage-0 DeepSpeed checkpoint names no parameters, and its optimizer "
                                  f"updates {len(index)} while its module has {len(self.params)}: it cannot be matched")
        by_index = dict(zip(index, self.params, strict=True))
        self.groups = [[by_index[i] for i in g["params"]] for g in inner["param_groups"]]
        self.inner = {by_index[i]: st for i, st in inner["state"].items()}
        self.settings = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        for gi, copies in enumerate(opt.get("fp32_groups") or []):
            for name, copy in zip(self.groups[gi], copies, strict=True):
                self.masters[name] = copy

    def _zero(self, first: dict[str, Any]) -> None:
        shapes = self.head.get("param_shapes") or []
        self.groups = [list(g) for g in shapes]
        self.params = [n for g in self.groups for n in g]
        self.shapes = {n: tuple(s) for g in shapes for n, s in g.items()}
        self.frozen = {n: tuple(s) for n, s in (self.head.get("frozen_param_shapes") or {}).items()}
        inner = first["base_optimizer_state"] if not self.stage3 else first["optimizer_state_dict"]
        self.settings = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        if self.stage3:  # each rank's flat groups: its piece of every parameter, ceil(numel / world) each
            self.offset3: dict[str, int] = {}
            at = 0
            for n in self.params:
                self.offset3[n] = at
                at += -(-_numel(self.shapes[n]) // self.world)
        else:  # each group one flat vector: (group, offset in it) per parameter, and the partition size
            pads = first.get("param_alignment_paddings") or [[0] * len(g) for g in self.groups]
            self.offset12: dict[str, tuple[int, int]] = {}
            for gi, g in enumerate(self.groups):
                at = 0
                for n, pad in zip(g, pads[gi], strict=True):
                    self.offset12[n] = (gi, at)
                    at += _numel(self.shapes[n]) + pad
            self.partitions = [self._partition_size(first, gi) for gi in range(len(self.groups))]

    @staticmethod
    def _partition_size(first: dict[str, Any], gi: int) -> int:
        """Rank 0's partition of group ``gi`` is whole (only the last rank's is padded): its size is every one's."""
        return int(first["single_partition_of_fp32_groups"][gi].numel())

    def _optim(self, rank: int) -> dict[str, Any]:
        if self._optim_names is None:
            raise CheckpointError(f"{self.dir}: no optimizer files")
        name = self._optim_names[rank]
        if name not in self._files:
            file = self.dir / name
            if not file.is_file():
                raise CheckpointCorruptError(f"{file} is missing: the checkpoint was written by {self.world} ranks and "
                                             "each wrote one optimizer file")
            self._files[name] = _load(file)["optimizer_state_dict"]
        loaded: dict[str, Any] = self._files[name]
        return loaded

    def _model3(self, rank: int) -> dict[str, Any]:
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        if name not in self._files:
            self._files[name] = _load(self.dir / name) if rank else self.head
        loaded: dict[str, Any] = self._files[name]
        return loaded

    # ---------------------------------------------------------------------------------------------- reading
    def canonical(self, name: str) -> str:
        """The name DeepSpeed keeps a tied parameter under (the model may call it by another of its names)."""
        return self.shared.get(name, name)

    def _with_aliases(self, by_name: dict[str, Any]) -> dict[str, Any]:
        return {**by_name, **{a: by_name[s] for a, s in self.shared.items() if s in by_name}}

    def state_keys(self) -> dict[str, list[str]]:
        """Each trainable parameter's per-element optimizer state keys (under each of a tied parameter's names),
        and ``MASTER`` where DeepSpeed keeps a float32 copy of a half-precision weight."""
        return self._with_aliases(self._state_keys())

    def scalars(self) -> dict[str, dict[str, Any]]:
        """Each trainable parameter's optimizer scalars (Adam's ``step``), under each of its names."""
        return self._with_aliases(self._scalars())

    def _state_keys(self) -> dict[str, list[str]]:
        if self.stage == 0:
            out = {n: sorted(k for k, v in st.items() if _per_element(v, self.shapes[n]))
                   for n, st in self.inner.items()}
            for n in self.masters:
                out.setdefault(n, []).append(MASTER)
            return out
        flat = self._flat_state(0, 0)
        keys = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        half = any(t.dtype != torch.float32 for n, t in self.module.items() if n in self.shapes)
        return {n: keys + ([MASTER] if half else []) for n in self.params}

    def _scalars(self) -> dict[str, dict[str, Any]]:
        if self.stage == 0:
            return {n: {k: v for k, v in st.items() if not _per_element(v, self.shapes[n])}
                    for n, st in self.inner.items()}
        out = {}
        for gi, g in enumerate(self.groups):
            st = self._flat_state(0, gi)
            for n in g:
                out[n] = {k: v for k, v in st.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        return out

    def _flat_state(self, rank: int, gi: int) -> dict[str, Any]:
        inner = self._optim(rank)["optimizer_state_dict" if self.stage3 else "base_optimizer_state"]
        state: dict[str, Any] = inner["state"][gi]
        return state

    def read(self, kind: str, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the full flattened tensor: a model entry (``kind`` "model") or a parameter's
        optimizer state ``key`` (``MASTER``: its float32 copy)."""
        name = self.canonical(name)
        if kind == "model" and (name in self.buffers or name in self.frozen or
                                (self.stage == 0 and name not in self.masters)):
            if name in self.frozen and self.stage3:
                whole = torch.cat([self._model3(r)["frozen_param_fragments"][name].reshape(-1)
                                   for r in range(self.world)])
                return whole[start:end]
            return self.module[name].reshape(-1)[start:end].clone()
        if self.stage == 0:
            source = self.masters[name] if kind == "model" or key == MASTER else self.inner[name][key]
            return source.reshape(-1)[start:end].clone()
        if name not in self.shapes:
            raise CheckpointCorruptError(f"{self.dir}: no parameter {name!r}")
        master = kind == "model" or key == MASTER
        pieces = []
        if self.stage3:
            part = -(-_numel(self.shapes[name]) // self.world)
            for r in range(start // part if part else 0, -(-end // part) if part else 0):
                lo, hi = max(start, r * part), min(end, (r + 1) * part)
                flat = self._rank_flat3(r, master, key)
                at = self.offset3[name] + lo - r * part
                pieces.append(flat[at:at + hi - lo])
        else:
            gi, offset = self.offset12[name]
            size = self.partitions[gi]
            lo_f, hi_f = offset + start, offset + end
            for r in range(lo_f // size, -(-hi_f // size)):
                lo, hi = max(lo_f, r * size), min(hi_f, (r + 1) * size)
                flat = (self._optim(r)["single_partition_of_fp32_groups"][gi] if master
                        else self._flat_state(r, gi)[key])
                pieces.append(flat[lo - r * size:hi - r * size])
        out = torch.cat(pieces) if len(pieces) != 1 else pieces[0].clone()  # never a view of a mapped file
        if out.numel() != end - start:
            raise CheckpointCorruptError(f"{self.dir}: the partitions hold {out.numel()} of {name!r}'s elements "
                                         f"[{start}, {end})")
        return out

    def _rank_flat3(self, rank: int, master: bool, key: str) -> torch.Tensor:
        """Rank ``rank``'s stage-3 flat groups, one after the other: float32 weights, or the state ``key``."""
        cache = f"{rank}/{'master' if master else key}"
        if cache not in self._files:
            opt = self._optim(rank)
            groups = opt["fp32_flat_groups"] if master else \
                [opt["optimizer_state_dict"]["state"][gi][key] for gi in range(len(opt["fp32_flat_groups"]))]
            self._files[cache] = torch.cat([g.reshape(-1) for g in groups]) if len(groups) > 1 else groups[0]
        flat: torch.Tensor = self._files[cache]
        return flat

    # ---------------------------------------------------------------------------------------------- what it says
    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every model state-dict entry DeepSpeed saved, by name, with its shape."""
        out = {**self.shapes, **self.frozen}
        out.update({n: tuple(self.module[n].shape) for n in self.buffers})
        out.update({alias: out[source] for alias, source in self.shared.items() if source in out})
        order = list(self.module) or list(out)
        return {n: out[n] for n in order if n in out} | {n: s for n, s in out.items() if n not in order}

    def bind(self, names: list[str]) -> None:
        """Tied weights are named in DeepSpeed's files (``shared_params``): nothing to work out."""

    def dtype_of(self, name: str) -> torch.dtype:
        """A model entry's dtype as read: float32 masters for trainable weights, the saved dtype otherwise."""
        source = self.canonical(name)
        return self.module[source].dtype if source in self.buffers or source in self.frozen else torch.float32

    def optimizer_classes(self) -> set[str] | None:
        """The optimizer classes whose state this is, from the config's optimizer type (None: not known)."""
        kind = str(((self.head.get("ds_config") or {}).get("optimizer") or {}).get("type", "")).lower()
        return FAMILIES.get(kind)

    def optimizer_name(self) -> str:
        return f"DeepSpeed's {((self.head.get('ds_config') or {}).get('optimizer') or {}).get('type', 'own')}"

    def extra(self) -> dict[str, Any]:
        """The script's client_state, and under ``DEEPSPEED_KEY`` the engine's counters and scheduler state."""
        counters = {"global_steps": int(self.head.get("global_steps") or 0),
                    "global_samples": int(self.head.get("global_samples") or 0),
                    "skipped_steps": int(self.head.get("skipped_steps") or 0),
                    "lr_scheduler": self.head.get("lr_scheduler")}
        return {**{k: v for k, v in self.head.items() if k not in OWN}, DEEPSPEED_KEY: counters}

    def files(self) -> list[Path]:
        return sorted(self.dir.glob("*.pt"))

    def describe(self) -> str:
        dtype = next((str(t.dtype).removeprefix("torch.") for n, t in self.module.items() if n in self.shapes),
                     "float32")
        return (f"a DeepSpeed {self.head.get('ds_version', '?')} checkpoint (ZeRO stage {self.stage}, {self.world} "
                f"rank(s), {dtype} weights, global step {self.head.get('global_steps')})")


def _address(t: torch.Tensor) -> int:
    """Where a tensor's data starts: tied entries of a loaded state dict share it."""
    return int(t.untyped_storage().data_ptr()) + int(t.storage_offset()) * t.element_size()


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _per_element(v: Any, shape: tuple[int, ...]) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(shape)
