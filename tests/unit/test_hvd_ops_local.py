"""unidist.compat.horovod in one process: Horovod's errors before init, init/shutdown, argument checks.

The messages and builtin classes are real Horovod 0.28.1's (measured with horovod.torch under horovodrun);
every error is also a unidist error. Values are tested on every launcher by tests/multiproc/test_hvd_api.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import unidist.compat.horovod as hvd
from unidist.compat.horovod.basics import HorovodNotInitializedError, UnsupportedFeatureError
from unidist.compat.horovod.exceptions import HorovodInternalError
from unidist.errors import NotInitializedError, UnidistError

NOT_INIT = "Horovod has not been initialized; use hvd.init()."
TOPOLOGY = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous")
# the tensors here are CPU tensors: hvd.init's Manager (the local backend) is told the CPU, so that a GPU machine
# runs the same tests
LOCAL_ON_CPU = {"UNIDIST_BACKEND": "local", "UNIDIST_DEVICE": "cpu"}


def _local_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in LOCAL_ON_CPU.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    _local_on_cpu(monkeypatch)
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("name", [*TOPOLOGY, "stop_timeline"])
def test_before_init_every_query_raises_horovods_value_error(name: str) -> None:
    with pytest.raises(HorovodNotInitializedError) as info:
        getattr(hvd, name)()
    assert str(info.value) == NOT_INIT
    assert isinstance(info.value, ValueError) and isinstance(info.value, NotInitializedError)


def test_before_init_collectives_and_timeline_raise_too() -> None:
    assert not hvd.is_initialized()
    for call in (lambda: hvd.allreduce(torch.ones(2)), lambda: hvd.broadcast(torch.ones(1), 0),
                 lambda: hvd.start_timeline("/tmp/t.json"), lambda: hvd.barrier(), lambda: hvd.join()):
        with pytest.raises(ValueError, match="not been initialized"):
            call()
    assert hvd.ProcessSet([0]).size() is None  # Horovod: None until registered
    assert hvd.synchronize(12345) is None


def test_init_is_idempotent_and_restartable(started: None) -> None:
    mgr = hvd.basics.manager()
    assert hvd.init() is None and hvd.basics.manager() is mgr  # a second init is a no-op
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == \
        (0, 1, 0, 1, 0, 1)
    assert hvd.is_homogeneous() is True and hvd.global_process_set.ranks == [0]
    hvd.shutdown()
    hvd.shutdown()  # twice is fine
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.size()
    hvd.init(comm=[0])  # a list naming every rank is the world
    assert hvd.size() == 1 and hvd.basics.manager() is not mgr


def test_init_refuses_what_unidist_cannot_give(monkeypatch: pytest.MonkeyPatch) -> None:
    _local_on_cpu(monkeypatch)
    with pytest.raises(UnsupportedFeatureError, match="mpi4py communicator"):
        hvd.init(comm=object())
    with pytest.raises(UnsupportedFeatureError, match=r"the ranks \[1\]"):
        hvd.init(comm=[1])
    with pytest.raises(ValueError, match="dynamic"):
        hvd.init(process_sets="sometimes")
    assert not hvd.is_initialized()


def test_build_queries_answer_for_the_local_engine(started: None) -> None:
    assert (hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.gloo_enabled()) == (False,) * 4
    assert (hvd.ddl_built(), hvd.ccl_built()) == (False, False)
    assert hvd.nccl_built() == 0 and type(hvd.nccl_built()) is int
    # CUDA is built where torch was built with it (ROCm's torch answers is_available() too, with cuda_built False)
    assert hvd.cuda_built() == (torch.version.cuda is not None and torch.cuda.is_available())
    assert type(hvd.rocm_built()) is bool
    with pytest.raises(ValueError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()
    hvd.start_timeline("/tmp/unused-timeline.json")  # documented no-ops once initialized
    hvd.stop_timeline()


def test_argument_checks_match_horovods_classes(started: None) -> None:
    t = torch.arange(4.0)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        assert torch.equal(hvd.allreduce(t, average=False), t)
    with pytest.raises(AttributeError):
        hvd.allreduce(np.ones(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Tensor type torch\.BoolTensor is not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce(torch.ones(3, 3).t())
    with pytest.raises(IndexError):
        hvd.allgather(torch.tensor(1.0))
    with pytest.raises(HorovodInternalError, match="only supports AVERAGE and SUM"):
        hvd.reducescatter(t, op=hvd.Max)
    with pytest.raises(HorovodInternalError, match="Reduction op type not supported"):
        hvd.allreduce(t, op=42)
    with pytest.raises(ValueError, match="invalid root rank 1"):
        hvd.broadcast(t, 1)
    with pytest.raises(TypeError):
        hvd.broadcast(t, "0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="32-bit integer"):
        hvd.alltoall(t, splits=torch.tensor([4]))
    with pytest.raises(ValueError, match="greater than the first dimension"):
        hvd.alltoall(t, splits=[5])
    for err in (HorovodInternalError, UnsupportedFeatureError, HorovodNotInitializedError):
        assert issubclass(err, UnidistError)


def test_handles_and_names(started: None) -> None:
    t = torch.arange(3.0)
    h = hvd.allreduce_async(t, name="g")
    assert type(h) is int and hvd.poll(h) is True
    with pytest.raises(ValueError, match="same name as another tensor"):
        hvd.allreduce_async(t, name="g")
    assert torch.equal(hvd.synchronize(h), t)
    assert hvd.synchronize(h) is None  # Horovod: a cleared handle synchronizes to None ...
    with pytest.raises(ValueError, match=f"Handle {h} was not created or has been cleared"):
        hvd.poll(h)  # ... and polls to a ValueError
    h2 = hvd.allreduce_async(t, name="g")  # the name is free again
    out, splits = hvd.synchronize(hvd.alltoall_async(t))
    assert torch.equal(out, t) and splits.dtype == torch.int32 and splits.tolist() == [3]
    assert torch.equal(hvd.synchronize(h2), t)
    assert torch.equal(hvd.alltoall(t), t)  # no splits: the tensor alone


def test_process_sets_keep_horovods_rules(started: None, monkeypatch: pytest.MonkeyPatch) -> None:
    ps = hvd.ProcessSet([0])
    assert str(ps) == "ProcessSet(process_set_id=None, ranks=[0], mpi_comm=None)"
    assert ps != hvd.ProcessSet([0]) and ps.included() is True  # identity equality, as Horovod's
    with pytest.raises(ValueError, match="list of process ranks"):
        hvd.ProcessSet(["a"])  # type: ignore[list-item]
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set([0])  # the global set's ranks
    assert hvd.remove_process_set(hvd.global_process_set) is False
    assert hvd.remove_process_set(ps) is False  # never registered
    assert hvd.global_process_set.size() == 1 and hvd.global_process_set.rank() == 0


def test_inside_a_unidist_block_hvd_uses_its_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    import unidist

    _local_on_cpu(monkeypatch)
    with unidist.init() as mgr:
        hvd.init()
        assert hvd.basics.manager() is mgr and hvd.size() == mgr.size
        assert torch.equal(hvd.allreduce(torch.arange(3.0)), torch.arange(3.0))
        hvd.shutdown()  # the block owns the Manager: it goes on
        assert mgr.started and not hvd.is_initialized()
    assert not mgr.started
