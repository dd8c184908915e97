"""unidist.compat.deepspeed.config: the config table (each KEYS row's default, each refused key's error), unknown
keys with suggestions, the batch triple with DeepSpeed's texts and initialize's config sources; with deepspeed
importable, defaults and batch arithmetic compared with DeepSpeed 0.19.8's own DeepSpeedConfig."""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from unidist.compat.deepspeed import config as dsc
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.compat.deepspeed.keys import DS_ONLY, IGNORED, KEYS, REMOVED, Key, markdown
from unidist.errors import ConfigError

BASE: Mapping[str, Any] = {"train_batch_size": 8}
BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def nest(name: str, value: Any, base: Mapping[str, Any] = BASE) -> dict[str, Any]:
    """``base`` plus dotted ``name`` set to ``value`` ({"a": {"b": v}} for "a.b")."""
    out: dict[str, Any] = json.loads(json.dumps(base))
    head, _, leaf = name.rpartition(".")
    node = out
    for part in filter(None, head.split(".")):
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def parse(raw: Mapping[str, Any], world: int = 1, on_deepspeed: bool = False) -> dsc.DSConfig:
    return dsc.parse(raw, world, on_deepspeed=on_deepspeed)


# ----------------------------------------------------------------- the table
def test_table_rows_are_unique_and_well_formed() -> None:
    names = [k.name for k in KEYS]
    assert len(names) == len(set(names))
    for row in KEYS:
        assert row.where in ("every backend", DS_ONLY, IGNORED, REMOVED) and row.here
        assert (row.fine is not None) == (row.where == DS_ONLY), row.name
    table = markdown().splitlines()  # the docs' table: one line per row
    assert all(f"| `{k.name}` |" in line for k, line in zip(KEYS, table[2:], strict=True))


@pytest.mark.parametrize("row", [k for k in KEYS if k.where != REMOVED], ids=lambda k: k.name)
def test_default_when_absent_and_accepted_when_given(row: Key) -> None:
    cfg = parse(BASE)
    if row.name not in BATCH:  # the triple's absent members are inferred (test_batch_triple_inference)
        assert cfg.get(row.name) == row.default
    if row.default is not None and not (row.kind == "dict" and "." not in row.name):
        section = row.name.split(".")[0]
        base = {**BASE, section: {"type": "X"}} if section in ("optimizer", "scheduler") else BASE
        given = parse(nest(row.name, row.default, base))  # DeepSpeed's default, written out, is accepted everywhere
        assert given.get(row.name) == row.default and given.deepspeed_only() == {}


def test_dataclass_fields_carry_deepspeeds_defaults() -> None:
    cfg = parse(BASE)
    assert (cfg.gradient_clipping, cfg.zero_stage, cfg.reduce_bucket_size) == (1.0, 0, 500_000_000)
    assert (cfg.optimizer, cfg.scheduler, cfg.steps_per_print) == (None, None, None)
    assert not (cfg.bf16_enabled or cfg.zero_allow_untested_optimizer or cfg.dataloader_drop_last
                or cfg.wall_clock_breakdown)
    assert cfg.fp16 == {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                        "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1, "auto_cast": False,
                        "fp16_master_weights_and_grads": False}
    assert cfg.precision() == "32" and cfg.deepspeed_only() == {}


# A value asking for each DeepSpeed-only feature (the rest are derived from the row's default).
_WANTED: Mapping[str, Any] = {
    "zero_optimization.offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
    "zero_optimization.offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
    "zero_optimization.zenflow": {"topk_ratio": 0.1},
    "zero_optimization.leaf_module": {"classes": ["MixtralSparseMoeBlock"]},
    "zero_optimization.zero_hpz_partition_size": 8,
    "sequence_parallel_size": 2,
    "gradient_allreduce_op": "sum",
    "communication_data_type": "bf16",
    "seq_parallel_communication_data_type": "bf16",
    "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    "hybrid_engine": {"enabled": True},
    "data_efficiency": {"enabled": True},
    "aio": {"block_size": 1048576},
    "pipeline": {"stages": "auto"},
    "tensor_parallel": {"autotp_size": 2},
    "expert_parallel": {"enabled": True},
    "weight_quantization": {"post_init_quant": {}},
    "compile": {"deepcompile": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "checkpoint": {"load_universal": True},
    "datastates_ckpt": {"host_cache_size": 16},
}


def wanted(row: Key) -> Any:
    if row.name in _WANTED:
        return _WANTED[row.name]
    if row.kind == "bool" or isinstance(row.default, bool):
        return not row.default
    if row.default is None:  # the deprecated cpu_offload* flags
        return True
    raise AssertionError(f"no wanted value for {row.name}")


DS_ONLY_ROWS = [k for k in KEYS if k.where == DS_ONLY]


@pytest.mark.parametrize("row", DS_ONLY_ROWS, ids=lambda k: k.name)
def test_deepspeed_only_key_refused_off_deepspeed_and_listed_on_it(row: Key) -> None:
    value = wanted(row)
    assert row.fine is not None and not row.fine(value)
    with pytest.raises(DeepSpeedUnsupportedError, match=f"{row.name}.*deepspeed launcher") as err:
        parse(nest(row.name, value))
    assert isinstance(err.value, NotImplementedError)
    on_ds = parse(nest(row.name, value), on_deepspeed=True)
    assert on_ds.ds_only == {row.name: value} and on_ds.deepspeed_only() == nest(row.name, value, {})


@pytest.mark.parametrize(("name", "value"), [
    ("zero_optimization.cpu_offload", False),  # DSE cifar10_deepspeed.py sets it
    ("zero_optimization.offload_optimizer", {"device": "none"}),
    ("zero_optimization.offload_param", None),
    ("torch_autocast", {"enabled": False}),
    ("communication_data_type", "fp32"),
    ("gradient_allreduce_op", "MEAN"),
])
def test_deepspeed_only_key_asking_for_nothing_is_accepted(name: str, value: Any) -> None:
    assert parse(nest(name, value)).deepspeed_only() == {}


@pytest.mark.parametrize(("name", "value"), [
    ("zero_optimization.offload_optimizer", {"device": "cpu", "pin_memory": True}),
    ("zero_optimization.offload_param", {"device": "cpu"}),
    ("zero_optimization.cpu_offload", True), ("zero_optimization.cpu_offload_param", True)])
def test_cpu_offload_is_prepares_offload_off_deepspeed_and_the_users_keys_on_it(name: str, value: Any) -> None:
    stage3 = {**BASE, "zero_optimization": {"stage": 3}}
    off = parse(nest(name, value, stage3))
    assert off.offload() == "cpu" and off.deepspeed_only() == {}
    on = parse(nest(name, value, stage3), on_deepspeed=True)
    assert on.ds_only == {name: value}  # DeepSpeed's engine offloads as configured (pin_memory, ratio ...)
    assert parse(nest(name, {"device": "none"} if isinstance(value, dict) else False)).offload() is None


@pytest.mark.parametrize("row", [k for k in KEYS if k.where == REMOVED], ids=lambda k: k.name)
@pytest.mark.parametrize("on_deepspeed", [False, True])
def test_removed_key_refused_everywhere(row: Key, on_deepspeed: bool) -> None:
    with pytest.raises(DeepSpeedConfigError, match=row.name.rsplit(".", 1)[-1]):
        parse(nest(row.name, {"enabled": True}), on_deepspeed=on_deepspeed)


def test_ignored_keys_are_accepted_with_their_sections() -> None:
    cfg = parse({**BASE, "steps_per_print": 10, "wall_clock_breakdown": True, "tensorboard": {"enabled": True},
                 "flops_profiler": {"enabled": True, "profile_step": 1}, "comms_logger": {"enabled": True}})
    assert (cfg.steps_per_print, cfg.wall_clock_breakdown, cfg.deepspeed_only()) == (10, True, {})


# ----------------------------------------------------------------- unknown keys, values
@pytest.mark.parametrize(("raw", "key", "hint"), [
    ({"gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e7}}, "zero_optimization.reduce_bucket_sise",
     "reduce_bucket_size"),
    ({"fp16": {"enabled": True, "initial_scale_powr": 15}}, "fp16.initial_scale_powr", "initial_scale_power"),
    ({"bf16": {"enable": True}}, "bf16.enable", "enabled"),
    ({"optimizer": {"type": "Adam", "parms": {"lr": 1e-3}}}, "optimizer.parms", "params"),
    ({"scheduler": {"typ": "WarmupLR"}}, "scheduler.typ", "type"),
])
def test_unknown_key_refused_with_a_suggestion(raw: Mapping[str, Any], key: str, hint: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=rf"'{key}' \(did you mean '{hint}'\?\)") as err:
        parse({**BASE, **raw}, on_deepspeed=True)
    assert isinstance(err.value, ConfigError)


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("gradient_clipping", "1.0", "a finite number"), ("gradient_clipping", -1, "a number >= 0"),
    ("zero_optimization.stage", 4, "a ZeRO stage: 0, 1, 2 or 3"), ("zero_optimization.stage", True, "an integer"),
    ("zero_optimization.reduce_bucket_size", 0, "an integer > 0"), ("fp16.enabled", "yes", "true or false"),
    ("train_batch_size", 8.5, "an integer"), ("optimizer", "Adam", "a JSON object"),
    ("gradient_accumulation_steps", "auto", r"an integer, got 'auto' \(\"auto\" is filled in by Hugging Face"),
])
def test_bad_value_names_the_key(name: str, value: Any, expected: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=f"'{name}' must be {expected}"):
        parse(nest(name, value))


def test_values_follow_deepspeed_coercions_and_sections() -> None:
    cfg = parse({**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": "auto",
                                               "stage3_prefetch_bucket_size": 1e6},
                 "bfloat16": {"enabled": True}, "gradient_clipping": 0})
    assert (cfg.zero_stage, cfg.reduce_bucket_size, cfg.gradient_clipping) == (2, 50_000_000, 0.0)
    assert isinstance(cfg.reduce_bucket_size, int) and cfg.get("zero_optimization.overlap_comm") is None
    assert cfg.get("zero_optimization.prefetch_bucket_size") == 1_000_000  # pydantic's field name for the alias
    assert cfg.bf16_enabled and cfg.precision() == "bf16-master"  # DeepSpeed's meaning: unidist/precisions.py
    assert parse({**BASE, "zero_optimization": True}).zero_stage == 1  # DeepSpeed's deprecated form
    assert parse({**BASE, "fp16": {"enabled": True}}).precision() == "fp16-mixed"


def test_fp16_and_bf16_together_refused() -> None:
    with pytest.raises(DeepSpeedConfigError, match="bfloat16 and fp16 modes cannot be simultaneously enabled"):
        parse({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_dynamic_loss_scale_needs_a_window_and_floor() -> None:
    with pytest.raises(DeepSpeedConfigError, match="loss_scale_window must be > 0"):
        parse({**BASE, "fp16": {"enabled": True, "loss_scale_window": 0}})
    assert parse({**BASE, "fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 0}}).fp16["loss_scale"] == 128


# ----------------------------------------------------------------- the batch triple (config.py:590-651)
def triple(raw: Mapping[str, Any], world: int) -> tuple[int, int, int]:
    cfg = parse(raw, world)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batch_triple_inference(world: int) -> None:
    tb, mb, gas = 16 * world, 4, 4
    assert triple({"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb}, world) == (tb, mb, tb // mb // world)
    assert triple({"train_batch_size": tb, "gradient_accumulation_steps": gas}, world) == (tb, tb // world // gas, gas)
    assert triple({"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas}, world) == \
        (mb * gas * world, mb, gas)
    assert triple({"train_batch_size": tb}, world) == (tb, tb // world, 1)
    assert triple({"train_micro_batch_size_per_gpu": mb}, world) == (mb * world, mb, 1)


BATCH_ERRORS = [  # (config, world, DeepSpeed's text)
    ({"gradient_accumulation_steps": 2}, 1, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
                                            "provided"),
    ({"train_batch_size": 0}, 1, "Train batch size: 0 has to be greater than 0"),
    ({"train_batch_size": 1}, 2, "Micro batch size per gpu: 0 has to be greater than 0"),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 8}, 1,
     "Gradient accumulation steps: 0 has to be greater than 0"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3}, 1, "Check batch related parameters. "
     "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 8 != 3 * 2 * 1"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2,
     "16 != 2 * 2 * 2"),
]


@pytest.mark.parametrize(("raw", "world", "text"), BATCH_ERRORS)
def test_batch_triple_errors_keep_deepspeeds_texts(raw: Mapping[str, Any], world: int, text: str) -> None:
    with pytest.raises(DeepSpeedConfigError) as err:
        parse(raw, world)
    assert text in str(err.value)


# ----------------------------------------------------------------- initialize's config sources
def test_load_source_rules(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 4, "fp16": {"enabled": False}}))
    assert dsc.load_source(None, {"train_batch_size": 2}, None) == {"train_batch_size": 2}
    assert dsc.load_source(None, None, {"train_batch_size": 3}) == {"train_batch_size": 3}
    assert dsc.load_source(None, str(path), None)["train_batch_size"] == 4
    args = SimpleNamespace(deepspeed_config=None, deepscale_config=str(path))
    assert dsc.load_source(args, None, None)["train_batch_size"] == 4
    assert (args.deepspeed_config, args.deepscale_config) == (str(path), None)  # moved, as DeepSpeed does
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 5}').decode()
    assert dsc.load_source(None, encoded, None) == {"train_batch_size": 5}
    with pytest.raises(DeepSpeedConfigError, match="Not sure how to proceed, we were given deepspeed configs in the "
                                                   r"deepspeed arguments and deepspeed.initialize\(\) function call"):
        dsc.load_source(SimpleNamespace(deepspeed_config=str(path)), {"train_batch_size": 2}, None)
    with pytest.raises(DeepSpeedConfigError, match="DeepSpeed requires --deepspeed_config to specify configuration"):
        dsc.load_source(SimpleNamespace(deepspeed_config=None), None, None)
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 4, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(DeepSpeedConfigError, match="Duplicate keys in DeepSpeed config"):
        dsc.load_source(None, str(dup), None)
    with pytest.raises(DeepSpeedConfigError, match="path to an existing deepspeed config"):
        dsc.load_source(None, str(tmp_path / "missing.json"), None)


# ----------------------------------------------------------------- against DeepSpeed's own parser
class _Mpu:
    """DeepSpeed's model-parallel-unit interface: the data-parallel world size DeepSpeedConfig divides by."""

    def __init__(self, world: int) -> None:
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


@pytest.fixture(scope="module")
def ds_world() -> Iterator[Any]:
    """DeepSpeedConfig with any data-parallel world size: a 1-process gloo group (DeepSpeedConfig reads the
    rank from deepspeed.comm) and an mpu giving the size; torn down (and the environment restored) after."""
    pytest.importorskip("deepspeed")
    import deepspeed.comm as dcomm
    import torch.distributed as td
    from deepspeed.runtime.config import DeepSpeedConfig

    env = dict(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    # as unidist's deepspeed manager does: init_distributed would JIT-compile DeepSpeed's CPU shared-memory op
    # (44-74 s on a clean machine) that only its inference_all_reduce uses
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dcomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)
    try:
        yield lambda raw, world: DeepSpeedConfig(dict(raw), mpu=_Mpu(world))
    finally:
        dcomm.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


DS_CONFIGS = [
    ({"train_batch_size": 16}, 1), ({"train_batch_size": 16}, 4), ({"train_micro_batch_size_per_gpu": 3}, 2),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 48, "gradient_accumulation_steps": 3}, 4),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5}, 3),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2),
    ({"train_batch_size": 16, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7},
      "fp16": {"enabled": True, "loss_scale_window": 500, "initial_scale_power": 15}}, 2),
    ({"train_batch_size": 16, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}, 1),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 5}, 1),
] + [(raw, world) for raw, world, _ in BATCH_ERRORS]


@pytest.mark.deepspeed
@pytest.mark.parametrize(("raw", "world"), DS_CONFIGS)
def test_batch_triple_and_values_match_deepspeed(ds_world: Any, raw: Mapping[str, Any], world: int) -> None:
    refused: str | None = None
    try:
        ds = ds_world(raw, world)
    except AssertionError as err:  # DeepSpeed's batch assertions: ours raise the same text
        refused = str(err)
    if refused is not None:
        with pytest.raises(DeepSpeedConfigError) as ours:
            parse(raw, world)
        assert str(ours.value) == refused
        return
    cfg = parse(raw, world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
    assert (cfg.gradient_clipping, cfg.zero_stage, cfg.reduce_bucket_size) == \
        (ds.gradient_clipping, ds.zero_optimization_stage, ds.zero_config.reduce_bucket_size)
    assert (cfg.fp16["enabled"], cfg.bf16_enabled) == (ds.float16_config.enabled, ds.bfloat16_config.enabled)
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        assert cfg.fp16[key] == getattr(ds.float16_config, key), key
    compared = [k.name for k in KEYS if "." not in k.name and k.where != REMOVED and hasattr(ds, k.name)
                and isinstance(getattr(ds, k.name), (bool, int, float, str, type(None)))]
    assert len(compared) >= 12  # the top-level rows DeepSpeedConfig keeps under the key's own name
    for name in compared:
        assert cfg.get(name) == getattr(ds, name), name


@pytest.mark.deepspeed
def test_section_defaults_match_deepspeeds_models() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    models = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}
    checked = 0
    for row in KEYS:
        section, _, leaf = row.name.partition(".")
        if section not in models or not leaf or row.where == REMOVED:
            continue
        fields = {(f.alias or n): f for n, f in models[section].model_fields.items()}
        assert leaf in fields, f"{row.name} is not a field of DeepSpeed's {models[section].__name__}"
        default = fields[leaf].get_default(call_default_factory=True)
        if isinstance(default, (bool, int, float, str)) or default is None:  # leaf_module's is a model
            assert row.default == default, row.name
            checked += 1
    declared = [(n, f.alias or n) for m in models.values() for n, f in m.model_fields.items()]
    rows = {k.name.partition(".")[2] for k in KEYS if k.name.partition(".")[0] in models}
    assert [alias for _, alias in declared if alias not in rows] == []  # every DeepSpeed field is a row
    assert checked == len(declared) - 1


def test_docs_key_table_is_the_parsers_table() -> None:
    """docs/deepspeed_config_keys.md lists exactly the keys the parser knows (regenerate it from keys.markdown())."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed_config_keys.md").read_text()
    assert doc.endswith(markdown()), "docs/deepspeed_config_keys.md is stale: regenerate its table from keys.markdown()"
