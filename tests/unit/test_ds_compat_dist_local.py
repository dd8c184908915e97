"""unidist.compat.deepspeed's init_distributed, comm, accelerator, moe/pipe and utils in one process (local backend).

References: real DeepSpeed 0.19.8's classes where deepspeed is importable (CPU_Accelerator, its ReduceOp, its
split_params_into_different_moe_groups_for_optimizer; ``deepspeed`` mark), numpy, and the socket layer (the
store really listens on MASTER_PORT). Every launcher is tested by tests/multiproc/test_ds_compat_dist.py.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import unidist
from unidist.compat.deepspeed import comm
from unidist.compat.deepspeed.accelerator import get_accelerator
from unidist.compat.deepspeed.dist import ENV_NAMES, init_distributed
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.errors import InvalidArgumentError, NotInitializedError
from unidist.net import free_port, listener

NOT_SET = "DeepSpeed backend not set, please initialize it using init_process_group()"


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The local backend on the CPU and none of DeepSpeed's variables (restored after the test: init_distributed
    sets them). The tensors here are CPU tensors and the accelerator follows the Manager's device where
    DS_ACCELERATOR is unset (a GPU machine's set-up may export DS_ACCELERATOR=cuda): the same world on every
    machine, gloo; test_a_gpu_world_is_nccl_beside_gloo is the GPU's."""
    monkeypatch.setenv("UNIDIST_BACKEND", "local")
    monkeypatch.setenv("UNIDIST_DEVICE", "cpu")
    for name in (*ENV_NAMES, "LOCAL_SIZE", "DS_ACCELERATOR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def mgr(clean: pytest.MonkeyPatch) -> Iterator[Any]:
    with unidist.init() as m:
        try:
            yield m
        finally:
            if comm.is_initialized():
                comm.destroy_process_group()
    assert not torch.distributed.is_initialized()


class Lines(logging.Handler):
    """The messages logged to DeepSpeed's logger."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[list[str]]:
    from unidist.compat.deepspeed.utils import logger

    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _port_is_held(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


# ------------------------------------------------------------------ init_distributed
def test_sets_the_five_variables_and_a_gloo_world_of_one(mgr: Any) -> None:
    port = free_port()
    init_distributed(distributed_port=port)
    assert {n: os.environ[n] for n in ENV_NAMES} == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert _port_is_held(port)  # the store really listens on MASTER_PORT
    dist = torch.distributed
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_rank() == mgr.rank == 0
    assert dist.get_backend() == "gloo"  # on a GPU machine too: the Manager is on the CPU (clean)
    world = dist.group.WORLD
    init_distributed(distributed_port=port)  # a second call is a no-op
    assert dist.group.WORLD is world and os.environ["MASTER_PORT"] == str(port)
    comm.destroy_process_group()
    assert not dist.is_initialized() and not comm.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs a CUDA device and a torch built with NCCL; this one lacks either")
def test_a_gpu_world_is_nccl_beside_gloo(clean: pytest.MonkeyPatch) -> None:
    """On a GPU the accelerator is CUDA's, so the world is nccl for CUDA tensors and gloo beside it for the CPU
    tensors a script (and unidist's own control messages) still pass: torch reports both."""
    clean.setenv("UNIDIST_DEVICE", "cuda")
    with unidist.init() as m:
        try:
            assert m.device.type == "cuda"
            init_distributed(distributed_port=free_port())
            assert torch.distributed.get_backend() == "cpu:gloo,cuda:nccl"
        finally:
            if comm.is_initialized():
                comm.destroy_process_group()
    assert not torch.distributed.is_initialized()


def test_a_taken_distributed_port_gives_a_free_one_with_a_warning(mgr: Any, logged: list[str]) -> None:
    held = listener("127.0.0.1", 0)
    try:
        taken = held.getsockname()[1]
        init_distributed(distributed_port=taken)
        assert os.environ["MASTER_PORT"] != str(taken) and _port_is_held(int(os.environ["MASTER_PORT"]))
        assert any(f"distributed_port {taken} is taken" in line for line in logged)
    finally:
        held.close()


def test_variables_already_set_are_kept(mgr: Any, clean: pytest.MonkeyPatch) -> None:
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        clean.setenv(name, value)
    init_distributed(distributed_port=1)  # DeepSpeed ignores distributed_port when all five are set
    assert os.environ["MASTER_PORT"] == str(port) and _port_is_held(port)


def test_argument_errors_are_typed(mgr: Any) -> None:
    with pytest.raises(NotInitializedError, match="Please set dist_init_required to True"):
        init_distributed(dist_init_required=False)
    with pytest.raises(DeepSpeedUnsupportedError, match="'ccl'"):
        init_distributed(dist_backend="ccl")
    with pytest.raises(InvalidArgumentError, match="use 'gloo'"):
        init_distributed(dist_backend="nccl" if not torch.cuda.is_available() else "bogus")
    with pytest.raises(InvalidArgumentError, match="rank 0"):
        init_distributed(rank=3)
    with pytest.raises(InvalidArgumentError, match="timedelta"):
        init_distributed(timeout=30)  # type: ignore[arg-type]
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------ deepspeed.comm
@pytest.mark.parametrize("call", ["get_rank", "get_world_size", "get_local_rank", "barrier", "all_reduce"])
def test_comm_before_init_raises_deepspeeds_text_typed(clean: pytest.MonkeyPatch, call: str) -> None:
    args = (torch.ones(2),) if call == "all_reduce" else ()
    assert not comm.is_initialized()
    with pytest.raises(NotInitializedError, match=NOT_SET):
        getattr(comm, call)(*args)


def test_comm_calls_on_a_world_of_one(mgr: Any) -> None:
    init_distributed()
    rng = np.random.default_rng(7)
    x = rng.normal(0, 50, size=(6, 5)).astype(np.float32)
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_global_rank()) == (0, 1, 0, 0)
    for op in comm.ReduceOp:
        if op is comm.ReduceOp.UNUSED:
            with pytest.raises(InvalidArgumentError):
                comm.all_reduce(torch.from_numpy(x.copy()), op)
            continue
        t = torch.from_numpy(x.copy()) if op.name not in ("BAND", "BOR", "BXOR") else torch.arange(30) * 3
        want = t.clone()
        assert comm.all_reduce(t, op) is None
        assert torch.equal(t, want), op  # one rank: every reduction is the identity
    t = torch.from_numpy(x.copy())
    work = comm.all_reduce(t, torch.distributed.ReduceOp.SUM, async_op=True)  # torch's own op passes through
    work.wait()
    np.testing.assert_array_equal(t.numpy(), x)
    out = [torch.empty(6, 5)]
    comm.all_gather(out, torch.from_numpy(x))
    np.testing.assert_array_equal(out[0].numpy(), x)
    flat = torch.empty(6, 5)
    comm.all_gather_into_tensor(flat, torch.from_numpy(x))
    np.testing.assert_array_equal(flat.numpy(), x)
    comm.reduce_scatter_tensor(flat.zero_(), torch.from_numpy(x), op=comm.ReduceOp.MAX)
    np.testing.assert_array_equal(flat.numpy(), x)
    b = torch.from_numpy(x.copy())
    comm.broadcast(b, 0)
    comm.barrier()
    np.testing.assert_array_equal(b.numpy(), x)
    group = comm.new_group([0])
    assert comm.get_world_size(group) == 1 and comm.get_global_rank(group, 0) == 0
    objs: list[Any] = [None]
    comm.all_gather_object(objs, {"rank": 0})
    assert objs == [{"rank": 0}]


@pytest.mark.deepspeed
def test_reduce_op_is_deepspeeds() -> None:
    reduce_op = pytest.importorskip("deepspeed.comm.reduce_op")
    assert [(m.name, m.value) for m in comm.ReduceOp] == [(m.name, m.value) for m in reduce_op.ReduceOp]


# ------------------------------------------------------------------ accelerator
ACCEL_CALLS = ("device_name()", "device_name(0)", "device_name(1)", "current_device_name()", "device_count()",
               "is_available()", "is_bf16_supported()", "bool(is_fp16_supported())", "communication_backend_name()",
               "device(0)", "current_device()", "set_device(0)", "synchronize()", "is_synchronized_device()")


def _answers(acc: Any) -> dict[str, Any]:
    out = {}
    for call in ACCEL_CALLS:
        name, _, rest = call.partition("(")
        wrap = name == "bool"
        if wrap:
            name, _, rest = rest.partition("(")
        arg = rest.rstrip(")")
        got = getattr(acc, name)(*([int(arg)] if arg else []))
        out[call] = bool(got) if wrap else got
    return out


@pytest.mark.deepspeed
@pytest.mark.parametrize("env", [{}, {"LOCAL_RANK": "1", "LOCAL_SIZE": "3"}])
def test_cpu_answers_equal_deepspeeds_cpu_accelerator(clean: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    cpu = pytest.importorskip("deepspeed.accelerator.cpu_accelerator")
    for name, value in env.items():
        clean.setenv(name, value)
    clean.setenv("DS_ACCELERATOR", "cpu")
    ours, theirs = get_accelerator(), cpu.CPU_Accelerator()
    assert _answers(ours) == _answers(theirs)
    ours.manual_seed(1234)
    a = torch.rand(5)
    theirs.manual_seed(1234)
    assert torch.equal(a, torch.rand(5))


def test_accelerator_choice(clean: pytest.MonkeyPatch) -> None:
    from unidist.compat.deepspeed.accelerator.real_accelerator import get_accelerator as real_get

    assert real_get() is get_accelerator()
    assert get_accelerator().device_name() == ("cuda" if torch.cuda.is_available() else "cpu")
    clean.setenv("DS_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert acc is get_accelerator() and acc.communication_backend_name() == "gloo"
    clean.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(DeepSpeedUnsupportedError, match="xpu"):
        get_accelerator()
    clean.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(DeepSpeedConfigError, match="DS_ACCELERATOR must be one of"):
        get_accelerator()


# ------------------------------------------------------------------ moe, pipe, utils
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _groups(model: torch.nn.Module) -> list[Any]:
    """Each accepted input form, as DSE cifar (a dict with 'name') and optimizers (a list, a tuple) pass them."""
    ps = list(model.parameters())
    return [{"params": ps, "name": "parameters"},
            [{"params": ps[:2], "name": "a", "lr": 0.1}, {"params": ps[2:], "name": "b"}],
            ({"params": ps, "name": "t", "weight_decay": 3e-7},)]


def test_moe_layer_and_its_param_groups(mgr: Any) -> None:
    """DeepSpeed's MoE layer builds here (one rank: ep_size 1); its experts are marked as DeepSpeed marks them and
    the split moves them into a group of their own with DeepSpeed's keys; what it cannot do is refused."""
    from unidist.compat.deepspeed.moe import layer, utils

    model = _model()
    moe = layer.MoE(hidden_size=2, expert=torch.nn.Linear(2, 2), num_experts=2)
    assert utils.has_moe_layers(torch.nn.Sequential(model, moe)) == (True, 2)
    assert not any(utils.is_moe_param(p) for p in model.parameters())
    experts = [p for p in moe.parameters() if utils.is_moe_param(p)]
    assert len(experts) == 4 and all(p.group_name == "ep_size_1" for p in experts)
    dense = list(model.parameters()) + list(moe.deepspeed_moe.gate.parameters())
    groups = utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": dense + experts, "name": "parameters", "lr": 0.1}, max_group_size=6)
    assert [g["name"] for g in groups] == ["parameters", "ep_size_1", "ep_size_1"]
    assert groups[0]["params"] == dense and groups[1]["moe"] and groups[1]["lr"] == 0.1
    assert groups[1]["params"] + groups[2]["params"] == experts  # cut at max_group_size elements
    with pytest.raises(DeepSpeedUnsupportedError, match="use_tutel"):
        layer.MoE(hidden_size=2, expert=torch.nn.Linear(2, 2), num_experts=2, use_tutel=True)
    with pytest.raises(ValueError, match="Unknown param group type"):
        utils.split_params_into_different_moe_groups_for_optimizer({1, 2})  # type: ignore[arg-type]


def test_split_without_moe_returns_the_groups() -> None:
    from unidist.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = _model()
    for given in _groups(model):
        got = split(given)
        want = [given] if isinstance(given, dict) else list(given)
        assert got == want
        if isinstance(given, list):
            assert got is given  # DeepSpeed edits and returns the caller's list


@pytest.mark.deepspeed
def test_split_without_moe_equals_deepspeeds() -> None:
    ds_utils = pytest.importorskip("deepspeed.moe.utils")
    from unidist.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = _model()
    for ours, theirs in zip(_groups(model), _groups(model), strict=True):
        got, want = split(ours), ds_utils.split_params_into_different_moe_groups_for_optimizer(theirs)
        assert [dict(g) for g in got] == [dict(g) for g in want]


def test_log_dist_follows_deepspeeds_rules(mgr: Any, logged: list[str]) -> None:
    from unidist.compat.deepspeed.utils import log_dist, logger

    assert logger.name == "DeepSpeed"
    log_dist("before", ranks=[5])
    init_distributed(verbose=False)
    for ranks in (None, [], [1], [0], [-1], [1, 0]):
        log_dist(f"after {ranks}", ranks=ranks)
    # only log_dist's lines: init_distributed may warn that port 29500 is taken (another job on this machine)
    assert [line for line in logged if line.startswith("[Rank")] == \
        ["[Rank -1] before", "[Rank 0] after [0]", "[Rank 0] after [-1]", "[Rank 0] after [1, 0]"]
