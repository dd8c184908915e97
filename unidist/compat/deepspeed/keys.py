"""The DeepSpeed 0.19.8 config keys ``unidist.compat.deepspeed`` knows: one row each, with DeepSpeed's default.

The table drives ``config.parse`` (which keys exist, their defaults, type checks, which are DeepSpeed-only), the
"Coming from DeepSpeed" docs and the config-table test, so what the docs promise is what the parser does.
Defaults are DeepSpeed's (``deepspeed/runtime/constants.py``, ``runtime/zero/config.py``,
``runtime/precision_config.py``), including the ones that change the math (``gradient_clipping`` 1.0).

``where`` says where a key works:
- ``every backend``: honoured (or, for tuning knobs that cannot change the result, accepted) on all backends;
- ``deepspeed only``: only DeepSpeed's engine can do it (offload, NVMe, ZeRO++, pipeline ...): off the deepspeed
  backend ``parse`` raises DeepSpeedUnsupportedError naming it, unless its value asks for nothing (``fine``:
  ``"cpu_offload": false``, ``"offload_optimizer": {"device": "none"}``, ``zero_hpz_partition_size`` 1 ...);
- ``ignored (logging)``: DeepSpeed's logging/profiling; accepted and ignored off DeepSpeed;
- ``removed``: DeepSpeed 0.19.8 itself refuses it (``runtime/config.py:96-141``): DeepSpeedConfigError everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CPU_OFFLOAD", "DS_ONLY", "EVERY", "IGNORED", "KEYS", "REFUSED", "REMOVED", "SECTIONS", "SYNONYMS", "Key",
           "by_name", "markdown"]

EVERY, DS_ONLY, IGNORED, REMOVED = "every backend", "deepspeed only", "ignored (logging)", "removed"


@dataclass(frozen=True)
class Key:
    """One config key: dotted ``name``, DeepSpeed's ``default``, ``where`` it works, what it does ``here`` (off
    DeepSpeed), its value ``kind`` (checked by config.parse) and, for a deepspeed-only key, ``fine``: the values
    that ask for nothing DeepSpeed-only (accepted everywhere)."""

    name: str
    default: Any
    where: str
    here: str
    kind: str = "any"  # bool | int | int>0 | int>=0 | num>=0 | num>0 | stage | str | dict | any
    fine: Callable[[Any], bool] | None = None


def _off(value: Any) -> bool:  # false/None/0/{}: the feature is not asked for
    return not value


def _disabled(value: Any) -> bool:  # a section with "enabled": false (or empty)
    return not value or (isinstance(value, Mapping) and not value.get("enabled", False))


def _no_device(value: Any) -> bool:  # offload_optimizer/offload_param with no device: offloads nothing
    return value is None or (isinstance(value, Mapping) and value.get("device", "none") in (None, "none"))


def _cpu_or_none(value: Any) -> bool:  # offload to the CPU: prepare(offload="cpu") does it on every backend
    return _no_device(value) or (isinstance(value, Mapping) and value.get("device") == "cpu")



# offload to the CPU, which every backend runs as prepare(offload="cpu"): the keys and whether a value asks for it
def _to_cpu(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("device") == "cpu"


CPU_OFFLOAD: Mapping[str, Callable[[Any], bool]] = {
    "zero_optimization.offload_optimizer": _to_cpu, "zero_optimization.offload_param": _to_cpu,
    "zero_optimization.cpu_offload": bool, "zero_optimization.cpu_offload_param": bool}
_CPU_HERE = ("device \"cpu\": prepare(offload=\"cpu\") on every backend (ZeRO 1-3: shards, their gradients and the "
             "optimizer state in host memory, stepped there); \"nvme\" refused off the deepspeed backend")


def _eq(default: Any) -> Callable[[Any], bool]:
    return lambda value: value == default


_NO_MATH = "accepted; a DeepSpeed tuning knob with no effect on the result (unidist's own ZeRO ignores it)"
_LOG = "accepted and ignored (DeepSpeed's logging/profiling)"
REFUSED = "refused off the deepspeed backend: only DeepSpeed's engine has it"

_ROWS: list[Key] = [
    # -- batch arithmetic (config.py:607-651) and the training math
    Key("train_batch_size", None, EVERY, "micro batch x accumulation x world; the missing one inferred", "int"),
    Key("train_micro_batch_size_per_gpu", None, EVERY, "samples per rank per backward (the dataloader's batch)",
        "int"),
    Key("gradient_accumulation_steps", None, EVERY, "micro steps per optimizer step (loss divided by it)", "int"),
    Key("gradient_clipping", 1.0, EVERY, "clip the global gradient L2 norm to it at each step; 0 switches it off",
        "num>=0"),
    Key("zero_allow_untested_optimizer", False, EVERY, "allow a non-Adam/AdamW/Adagrad optimizer with ZeRO >= 1",
        "bool"),
    Key("dataloader_drop_last", False, EVERY, "the training dataloader drops the last incomplete batch", "bool"),
    Key("prescale_gradients", False, EVERY, "accepted; gradients are averaged either way (rounding may differ)",
        "bool"),
    Key("gradient_predivide_factor", 1.0, EVERY, "accepted; gradients are averaged either way (rounding may differ)",
        "num>0"),
    Key("optimizer", None, EVERY, "the optimizer built on torch.optim (optimizers.py)", "dict"),
    Key("optimizer.type", None, EVERY, "Adam/AdamW/Adagrad (any case) or a torch.optim class name (exact case)",
        "str"),
    Key("optimizer.params", {}, EVERY, "the optimizer's keyword arguments (DeepSpeed's Adam weight-decay meaning)",
        "dict"),
    Key("optimizer.legacy_fusion", False, EVERY, "accepted; chooses DeepSpeed's fp16 optimizer kernel only", "bool"),
    Key("scheduler", None, EVERY, "the lr schedule (lr_schedules.py)", "dict"),
    Key("scheduler.type", None, EVERY, "WarmupLR/WarmupDecayLR/WarmupCosineLR/OneCycle or a torch lr_scheduler",
        "str"),
    Key("scheduler.params", {}, EVERY, "the schedule's keyword arguments", "dict"),
    # -- precision (precision_config.py)
    Key("fp16", {}, EVERY, "DeepSpeed's fp16 section", "dict"),
    Key("fp16.enabled", False, EVERY, "fp16 training with DeepSpeed's dynamic loss scale", "bool"),
    Key("fp16.loss_scale", 0, EVERY, "static loss scale; 0 = dynamic", "num>=0"),
    Key("fp16.initial_scale_power", 16, EVERY, "dynamic scale starts at 2**it", "int"),
    Key("fp16.loss_scale_window", 1000, EVERY, "good steps before the scale doubles (> 0 when dynamic)", "int"),
    Key("fp16.hysteresis", 2, EVERY, "overflows tolerated before the scale halves", "int"),
    Key("fp16.consecutive_hysteresis", False, EVERY, "refill hysteresis on every good step", "bool"),
    Key("fp16.min_loss_scale", 1, EVERY, "the dynamic scale's floor (> 0 when dynamic)", "num>=0"),
    Key("fp16.auto_cast", False, DS_ONLY, REFUSED + " (casting inputs to fp16)", "bool", _off),
    Key("fp16.fp16_master_weights_and_grads", False, DS_ONLY, REFUSED + " (fp16 master weights)", "bool", _off),
    Key("bf16", {}, EVERY, "DeepSpeed's bf16 section (old name: bfloat16)", "dict"),
    Key("bf16.enabled", False, EVERY, "precision='bf16-master': a bfloat16 model, float32 master copies", "bool"),
    Key("bf16.immediate_grad_update", False, EVERY, _NO_MATH, "bool"),
    Key("bf16.check_grad_overflow", True, EVERY, "accepted (DeepSpeed skips bf16 steps with inf/nan gradients)",
        "bool"),
    Key("bf16.bf16_master_weights_and_grads", False, DS_ONLY, REFUSED + " (bf16 master weights)", "bool", _off),
    Key("bf16.bf16_optimizer_states", False, DS_ONLY, REFUSED + " (bf16 optimizer states)", "bool", _off),
    Key("torch_autocast", {}, DS_ONLY, REFUSED + " (its autocast section); enabled false is accepted", "dict",
        _disabled),
    # -- ZeRO (zero/config.py)
    Key("zero_optimization", {}, EVERY, "DeepSpeed's ZeRO section", "dict"),
    Key("zero_optimization.stage", 0, EVERY, "ZeRO stage 0-3 on unidist's ZeRO", "stage"),
    Key("zero_optimization.reduce_bucket_size", 500_000_000, EVERY, "gradient bucket size in elements", "int>0"),
    Key("zero_optimization.allgather_bucket_size", 500_000_000, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.overlap_comm", None, EVERY, _NO_MATH),
    Key("zero_optimization.contiguous_gradients", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.reduce_scatter", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.use_multi_rank_bucket_allreduce", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.allgather_partitions", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.compute_grad_norm", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.load_from_fp32_weights", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.elastic_checkpoint", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.sub_group_size", 1_000_000_000, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.ignore_unused_parameters", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.round_robin_gradients", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.parameter_alignment", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.memory_efficient_linear", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.override_module_apply", True, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.log_trace_cache_warnings", False, IGNORED, _LOG, "bool"),
    Key("zero_optimization.enable_sanity_checks", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.pipeline_loading_checkpoint", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.save_muon_momentum_buffer_in_memory", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.stage3_prefetch_bucket_size", 50_000_000, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.stage3_param_persistence_threshold", 100_000, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.stage3_model_persistence_threshold", 2**63 - 1, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.stage3_max_live_parameters", 1_000_000_000, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.stage3_max_reuse_distance", 1_000_000_000, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.stage3_module_granularity_threshold", 0, EVERY, _NO_MATH, "int>=0"),
    Key("zero_optimization.stage3_use_all_reduce_for_fetch_params", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.stage3_allgather_sequential", False, EVERY, _NO_MATH, "bool"),
    Key("zero_optimization.stage3_gather_16bit_weights_on_model_save", False, EVERY,
        "accepted; checkpoints hold full fp32 weights anyway", "bool"),
    Key("zero_optimization.stage3_gather_fp16_weights_on_model_save", False, EVERY,
        "accepted (deprecated name of stage3_gather_16bit_weights_on_model_save)", "bool"),
    Key("zero_optimization.offload_optimizer", None, DS_ONLY, "optimizer offload: " + _CPU_HERE, "any",
        _cpu_or_none),
    Key("zero_optimization.offload_param", None, DS_ONLY, "parameter offload (stage 3): " + _CPU_HERE, "any",
        _cpu_or_none),
    Key("zero_optimization.cpu_offload", None, EVERY, "deprecated optimizer offload; true is "
        "prepare(offload=\"cpu\") (ZeRO 1-3)"),
    Key("zero_optimization.cpu_offload_param", None, EVERY, "deprecated parameter offload; true is "
        "prepare(offload=\"cpu\") (ZeRO 1-3)"),
    Key("zero_optimization.cpu_offload_use_pin_memory", None, EVERY, "deprecated offload option; accepted "
        "(host memory is pinned where a GPU is used)"),
    Key("zero_optimization.zenflow", None, DS_ONLY, REFUSED + " (ZenFlow offload)", "any", _off),
    Key("zero_optimization.zero_hpz_partition_size", 1, DS_ONLY, REFUSED + " (ZeRO++ hierarchical partitions)",
        "int>0", _eq(1)),
    Key("zero_optimization.zero_quantized_weights", False, DS_ONLY, REFUSED + " (ZeRO++ quantized weights)", "bool",
        _off),
    Key("zero_optimization.zero_quantized_nontrainable_weights", False, DS_ONLY, REFUSED + " (ZeRO++)", "bool",
        _off),
    Key("zero_optimization.zero_quantized_gradients", False, DS_ONLY, REFUSED + " (ZeRO++ quantized gradients)",
        "bool", _off),
    Key("zero_optimization.legacy_stage1", False, DS_ONLY, REFUSED + " (legacy stage 1)", "bool", _off),
    Key("zero_optimization.leaf_module", None, DS_ONLY, REFUSED + " (ZeRO-3 leaf modules)", "any", _off),
    # -- DeepSpeed-only top-level features (research 1.7)
    Key("zero_force_ds_cpu_optimizer", True, DS_ONLY, REFUSED + " (only matters with offload); true is accepted",
        "bool", _eq(True)),
    Key("gradient_allreduce_op", "mean", DS_ONLY, REFUSED + " (summed gradients); \"mean\" is accepted", "any",
        lambda v: isinstance(v, str) and v.lower() == "mean"),
    Key("communication_data_type", None, DS_ONLY, REFUSED + " (low-precision allreduce); fp32 is accepted", "any",
        lambda v: v is None or (isinstance(v, str) and v.lower() == "fp32")),
    Key("seq_parallel_communication_data_type", "fp32", DS_ONLY, REFUSED, "any",
        lambda v: isinstance(v, str) and v.lower() == "fp32"),
    Key("managed_gradient_accumulation", True, DS_ONLY, REFUSED + " (script-managed boundaries)", "bool",
        _eq(True)),
    Key("disable_allgather", False, DS_ONLY, REFUSED, "bool", _off),
    Key("aio", None, DS_ONLY, REFUSED + " (NVMe async I/O)", "dict", _off),
    Key("pipeline", None, EVERY, "a PipelineModule's engine settings, as DeepSpeed's: "
        "activation_checkpoint_interval > 0 sets the module's; pipe_partitioned/grad_partitioned act with tensor "
        "parallelism only (accepted); the rest accepted (the module's own arguments decide)", "dict"),
    Key("tensor_parallel", None, DS_ONLY, REFUSED + " (tensor parallelism)", "dict", _off),
    Key("sequence_parallel_size", 1, DS_ONLY, REFUSED + " (sequence parallelism)", "int>0", _eq(1)),
    Key("expert_parallel", None, DS_ONLY, REFUSED + " (MoE expert parallelism)", "dict", _off),
    Key("use_data_before_expert_parallelism", False, DS_ONLY, REFUSED + " (MoE topology)", "bool", _off),
    Key("hybrid_engine", None, DS_ONLY, REFUSED + " (RLHF hybrid engine)", "dict", _disabled),
    Key("data_efficiency", None, DS_ONLY, REFUSED + " (curriculum data sampling, random-LTD)", "dict", _disabled),
    Key("weight_quantization", None, DS_ONLY, REFUSED + " (weight quantization)", "dict", _off),
    Key("compile", None, DS_ONLY, REFUSED + " (DeepCompile)", "dict", _off),
    Key("data_types", None, DS_ONLY, REFUSED + " (grad-accumulation/param dtypes)", "dict", _off),
    Key("checkpoint", None, DS_ONLY, REFUSED + " (DeepSpeed checkpoint engine options)", "dict", _off),
    Key("datastates_ckpt", None, DS_ONLY, REFUSED + " (DataStates checkpointing)", "dict", _off),
    # -- logging / profiling: accepted, ignored off DeepSpeed
    Key("steps_per_print", None, IGNORED, _LOG, "any"),
    Key("wall_clock_breakdown", False, IGNORED, _LOG, "bool"),
    Key("memory_breakdown", False, IGNORED, _LOG, "bool"),
    Key("dump_state", False, IGNORED, _LOG, "bool"),
    Key("flops_profiler", None, IGNORED, _LOG, "dict"),
    Key("comms_logger", None, IGNORED, _LOG, "dict"),
    Key("tensorboard", None, IGNORED, _LOG, "dict"),
    Key("wandb", None, IGNORED, _LOG, "dict"),
    Key("csv_monitor", None, IGNORED, _LOG, "dict"),
    Key("comet", None, IGNORED, _LOG, "dict"),
    Key("timers", None, IGNORED, _LOG, "dict"),
    Key("log_level", None, IGNORED, _LOG, "any"),
    Key("autotuning", None, IGNORED, "accepted and ignored (read by DeepSpeed's launcher, not the engine)", "dict"),
    Key("vocabulary_size", None, IGNORED, "accepted and ignored (DeepSpeed only warns about its alignment)", "any"),
    Key("disable_python_gc", False, IGNORED, "accepted and ignored (a DeepSpeed performance knob)", "bool"),
    Key("activation_checkpointing", None, IGNORED,
        "accepted and ignored (configures deepspeed.checkpointing, which scripts call themselves)", "dict"),
]
# Removed in DeepSpeed 0.19.8: its parser raises DeepSpeedConfigError for them (config.py:96-141).
_ROWS += [Key(name, None, REMOVED, "refused everywhere: DeepSpeed 0.19.8 removed it") for name in (
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
    "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop",
    "zero_optimization.mics_shard_size", "zero_optimization.mics_hierarchical_params_gather",
    "zero_optimization.zeropp_loco_param")]

KEYS: tuple[Key, ...] = tuple(_ROWS)

# Sections whose inner keys parse checks (DeepSpeed forbids extra keys in them: config_utils.py:105-110).
SECTIONS: tuple[str, ...] = ("optimizer", "scheduler", "fp16", "bf16", "zero_optimization")

# Other spellings DeepSpeed accepts for a row: pydantic field names next to their aliases (populate_by_name).
SYNONYMS: Mapping[str, str] = {
    "bfloat16": "bf16",
    **{f"zero_optimization.{field}": f"zero_optimization.stage3_{field}" for field in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")},
}

_BY_NAME: Mapping[str, Key] = {k.name: k for k in KEYS}


def by_name(name: str) -> Key:
    """The row for dotted ``name`` (a synonym resolves to its row); KeyError when unknown."""
    return _BY_NAME[SYNONYMS.get(name, name)]


def markdown() -> str:
    """KEYS as a Markdown table (key, DeepSpeed's default, where it works, what it does off DeepSpeed), for the
    "Coming from DeepSpeed" docs, so they list exactly what the parser does."""
    lines = ["| key | DeepSpeed default | where | off DeepSpeed |", "|---|---|---|---|"]
    for row in KEYS:
        default = "-" if row.default is None else f"`{row.default!r}`"
        lines.append(f"| `{row.name}` | {default} | {row.where} | {row.here.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
