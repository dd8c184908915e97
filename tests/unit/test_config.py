"""Config.from_env: strict parsing, one error per bad variable, naming variable, value and allowed values."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from unidist import Config, ConfigError


def test_defaults() -> None:
    cfg = Config.from_env({})
    assert cfg == Config()
    assert (cfg.backend, cfg.timeout, cfg.zero_stage, cfg.bucket_mb, cfg.compression) == (None, 1800.0, 0, 25.0, "none")
    assert (cfg.check_collectives, cfg.log_level, cfg.device, cfg.deepspeed_config) == (None, "WARNING", "auto", None)


def test_every_variable_parsed() -> None:
    cfg = Config.from_env({
        "UNIDIST_BACKEND": "MPI", "UNIDIST_TIMEOUT": "12.5", "UNIDIST_ZERO_STAGE": "2", "UNIDIST_BUCKET_MB": "4",
        "UNIDIST_COMPRESSION": "FP16", "UNIDIST_CHECK_COLLECTIVES": "yes", "UNIDIST_LOG_LEVEL": "debug",
        "UNIDIST_DEVICE": "cuda:1", "UNIDIST_DEEPSPEED_CONFIG": "ds.json",
    })
    assert cfg == Config("mpi", 12.5, 2, 4.0, "fp16", True, "DEBUG", "cuda:1", "ds.json")


@pytest.mark.parametrize(("var", "value", "allowed"), [
    ("UNIDIST_TIMEOUT", "soon", "positive number of seconds"),
    ("UNIDIST_TIMEOUT", "-1", "positive number of seconds"),
    ("UNIDIST_TIMEOUT", "inf", "up to 2592000"),
    ("UNIDIST_TIMEOUT", "nan", "up to 2592000"),
    ("UNIDIST_TIMEOUT", "1e15", "up to 2592000"),
    ("UNIDIST_ZERO_STAGE", "4", "0, 1, 2 or 3"),
    ("UNIDIST_ZERO_STAGE", "1.5", "0, 1, 2 or 3"),
    ("UNIDIST_BUCKET_MB", "0", "positive number of MiB"),
    ("UNIDIST_COMPRESSION", "int8", "none, fp16, bf16"),
    ("UNIDIST_CHECK_COLLECTIVES", "maybe", "auto (one call in K"),
    ("UNIDIST_LOG_LEVEL", "loud", "DEBUG, INFO"),
    ("UNIDIST_DEVICE", "tpu", "auto, cpu, cuda"),
    ("UNIDIST_BACKEND", "my backend", "registered backend"),
])
def test_bad_value_names_variable_value_and_allowed(var: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({var: value})
    msg = str(info.value)
    assert var in msg
    assert repr(value) in msg
    assert allowed in msg


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match="UNIDIST_ZERO_STAGE=7"):
        Config(zero_stage=7)


def test_unknown_variable_warns_with_suggestion(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="unidist"):
        cfg = Config.from_env({"UNIDIST_TIMEOUTS": "3", "UNIDIST_CPUS": "4"})
    assert cfg.unknown == ("UNIDIST_CPUS", "UNIDIST_TIMEOUTS")
    assert "did you mean UNIDIST_TIMEOUT?" in caplog.text


def test_cuda_device_checked_against_what_torch_sees() -> None:
    import unidist

    mgr = unidist.init(environ={"UNIDIST_DEVICE": "cuda:99"})
    with pytest.raises(ConfigError, match=r"UNIDIST_DEVICE='cuda:99' but torch sees \d+ CUDA device"):
        mgr.start()
    assert not mgr.started


@pytest.mark.parametrize(("kind", "words"), [("missing", "does not exist"), ("directory", "is a directory"),
                                              ("not-json", "not valid JSON"), ("list", "JSON object")])
def test_deepspeed_config_path_errors(tmp_path: Path, kind: str, words: str) -> None:
    from unidist.engines.deepspeed.config import load as _load_config

    path = {"missing": tmp_path / "nope.json", "directory": tmp_path}.get(kind, tmp_path / "ds.json")
    if kind == "not-json":
        path.write_text("{stage: 2")
    elif kind == "list":
        path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=words) as info:
        _load_config(str(path))
    assert str(path) in str(info.value)
