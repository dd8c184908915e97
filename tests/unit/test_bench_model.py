"""``unidist bench model``: the cost formulas against hand-computed values, the fit recovering known
parameters from data the formulas generate, and the command on a small JSON fixture (no launcher)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from unidist.bench import costmodel as cm
from unidist.bench.model_measure import gamma_params
from unidist.errors import InvalidArgumentError

SIZES = (8, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
GAMMA = cm.Params(gamma=100e-12, gamma_mem=250e-12, gamma_cache=4 << 20)
TRUE = {"allreduce": cm.Link(6e-6, 150e-12, 400e-12, 1 << 20, 9e-6), "allgather": cm.Link(5e-6, 300e-12),
        "broadcast": cm.Link(4e-6, 120e-12, 180e-12, 1 << 20, 4e-6),
        "reduce_scatter": cm.Link(7e-6, 200e-12, 450e-12, 1 << 20, 7e-6),
        "alltoall": cm.Link(3e-6, 900e-12, 250e-12, 16 << 10, 20e-6)}  # a protocol switch at 16 KiB


def _truth() -> cm.Params:
    return cm.Params(dict(TRUE), GAMMA.gamma, GAMMA.gamma_mem, GAMMA.gamma_cache)


def _samples(kind: str, ranks: tuple[int, ...]) -> list[cm.Sample]:
    truth = _truth()
    return [(op, p, float(n), cm.predict(truth, kind, op, p, n)[0]) for op in TRUE for p in ranks for n in SIZES]


def test_formulas_match_hand_computed_values() -> None:
    n = 1200.0
    assert cm.ring_allreduce(4, n) == (6, 1800, 900)  # 2(p-1), 2(p-1)/p n, (p-1)/p n
    assert cm.recursive_doubling_allreduce(4, n) == (2, 2 * n, 2 * n)  # log2 p (alpha + n beta + n gamma)
    assert cm.recursive_doubling_allreduce(3, n) == (3, 3 * n, 2 * n)  # 2 ranks + fold-in and hand-back
    assert cm.rabenseifner_allreduce(8, n) == (6, 2 * 7 / 8 * n, 7 / 8 * n)  # 2 log2 p alpha
    assert cm.rabenseifner_allreduce(3, n) == (4, n + 2 * n, n / 2 + n)
    assert cm.ring_allgather(4, n) == (3, 900, 0)
    assert cm.recursive_doubling_allgather(8, n) == (3, 7 / 8 * n, 0)
    assert cm.binomial_broadcast(5, n) == (3, 3 * n, 0)  # ceil(log2 5) = 3 steps
    assert cm.scatter_allgather_broadcast(8, n) == (10, 2 * 7 / 8 * n, 0)
    assert cm.ring_reduce_scatter(4, n) == (3, 900, 900)
    assert cm.halving_reduce_scatter(4, n) == (2, 900, 900)
    assert cm.pairwise_alltoall(4, n) == (3, 900, 0)
    assert cm.bruck_alltoall(4, n) == (2, n, 0)
    # the ring's bandwidth term tends to 2n beta: the bus-bandwidth factor of nccl-tests
    assert cm.ring_allreduce(1024, n)[1] == pytest.approx(2 * n, rel=1e-3)
    # 4 ranks on 2 cores: each step's copies and adds take twice as long; latency terms unchanged
    assert cm.coefficients("allreduce", "ring", 4, n, cores=2) == (6, 3600, 1800)
    assert cm.coefficients("allreduce", "ring", 2, n, cores=2) == cm.ring_allreduce(2, n)


def test_time_is_the_linear_combination_and_regimes_follow_the_size() -> None:
    p = _truth()
    coeffs = cm.ring_allreduce(4, 8 << 20)
    want = 6 * 9e-6 + coeffs[1] * 400e-12 + coeffs[2] * 250e-12  # 8 MiB: above both splits (alpha_big too)
    assert p.time("allreduce", coeffs, 8 << 20) == pytest.approx(want)
    small = cm.ring_allreduce(4, 1024)
    assert p.time("allreduce", small, 1024) == pytest.approx(6 * 6e-6 + small[1] * 150e-12 + small[2] * 100e-12)
    with pytest.raises(InvalidArgumentError, match="no fitted costs for gather"):
        p.time("gather", small, 1024)


def test_known_algorithms_and_the_min_policy() -> None:
    assert cm.choose("mpich", "allreduce", 4, 2048) == "recursive_doubling"
    assert cm.choose("mpich", "allreduce", 4, 4096) == "rabenseifner"
    assert cm.choose("mpich", "broadcast", 4, 1 << 30) == "binomial"  # fewer than 8 ranks
    assert cm.choose("mpich", "broadcast", 16, 1 << 20) == "scatter_allgather"
    assert cm.choose("gloo", "allreduce", 4, 8) == "ring"
    p = _truth()
    # gloo's reduce_scatter is not documented here: the fastest under the parameters
    assert cm.choose("gloo", "reduce_scatter", 8, 8, p) == "recursive_halving"
    assert cm.choose("mpich", "allreduce", 1024, 8, p, policy="min") == "recursive_doubling"
    assert cm.engine_kind("mpi", "mpich") == "mpich" and cm.engine_kind("horovod", "mpich") == "mpich"
    assert cm.engine_kind("torch", "torchrun") == "gloo" and cm.engine_kind("horovod", "horovodrun") == "gloo"
    with pytest.raises(InvalidArgumentError, match="no cost formulas"):
        cm.choose("mpich", "scan", 2, 8)


def test_nnls_keeps_costs_non_negative() -> None:
    rows = [[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]
    assert cm.nnls(rows, [3.0, 5.0, 7.0]) == pytest.approx([1.0, 2.0])  # exact, unconstrained optimum
    x = cm.nnls(rows, [3.0, 2.0, 1.0])  # unconstrained: slope -1; constrained: a constant
    assert x[1] == 0.0 and x[0] == pytest.approx(2.0)


@pytest.mark.parametrize("kind", ["mpich", "gloo"])
def test_fit_recovers_known_parameters(kind: str) -> None:
    fitted = cm.fit(_samples(kind, (2,)), kind, GAMMA)
    for op, link in TRUE.items():
        got = fitted.links[op]
        for n in (8, 16 << 20):  # both regimes
            assert got.alpha_at(n) == pytest.approx(link.alpha_at(n), rel=1e-6), (op, n)
            assert got.beta_at(n) == pytest.approx(link.beta_at(n), rel=1e-6), (op, n)
    # and, fitted on 2 ranks, it predicts 3 and 4 exactly: the rank count enters through the formulas only
    for op, p, n, seconds in _samples(kind, (3, 4)):
        assert cm.predict(fitted, kind, op, p, n)[0] == pytest.approx(seconds, rel=1e-6)
    # fitted on every rank count with ranks sharing 2 cores, from data that shared them: the same links
    truth = _truth()
    shared = [(op, p, float(n), truth.time(op, cm.coefficients(op, cm.choose(kind, op, p, n), p, n, 2), n))
              for op in TRUE for p in (2, 3, 4) for n in SIZES]
    again = cm.fit(shared, kind, GAMMA, cores=2)
    assert again.links["allreduce"].alpha == pytest.approx(TRUE["allreduce"].alpha, rel=1e-6)
    assert again.links["alltoall"].beta == pytest.approx(TRUE["alltoall"].beta, rel=1e-6)


def test_gamma_step_is_recovered() -> None:
    rows = [{"bench": "gamma", "bytes": n, "seconds": n * (100e-12 if n <= 4 << 20 else 250e-12)}
            for n in (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)]
    assert gamma_params(rows) == (pytest.approx(100e-12), pytest.approx(250e-12), 4 << 20)
    flat = [{"bench": "gamma", "bytes": n, "seconds": n * 1e-10} for n in (1 << 20, 4 << 20)]
    assert gamma_params(flat)[:2] == (pytest.approx(1e-10), pytest.approx(1e-10))


def _doc(backend: str, launcher: str, ranks: int, kind: str) -> dict[str, Any]:
    rows = [{"bench": "collectives", "backend": backend, "launcher": launcher, "ranks": ranks, "op": op,
             "bytes": int(n), "time_us": 1.1 * s * 1e6, "raw_time_us": s * 1e6}
            for op, _, n, s in _samples(kind, (ranks,))]
    return {"meta": {"backend": backend, "launcher": launcher, "ranks": ranks}, "rows": rows}


def _fixture(tmp_path: Path) -> list[str]:
    files = []
    for ranks in (2, 3, 4):
        for backend, launcher, kind in (("mpi", "mpich", "mpich"), ("torch", "torchrun", "gloo")):
            path = tmp_path / f"{backend}-{ranks}.json"
            path.write_text(json.dumps(_doc(backend, launcher, ranks, kind)))
            files.append(str(path))
    gamma = [{"bench": "gamma", "bytes": n, "seconds": n * (100e-12 if n <= 4 << 20 else 250e-12)}
             for n in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)]
    (tmp_path / "gamma.json").write_text(json.dumps({"meta": {"bench": "gamma"}, "rows": gamma}))
    runs = [{"bench": "measure", "run": "mpi-2", "ranks": 2, "exit": 0, "seconds": 24.0, "load_before": 0.4,
             "load_after": 1.9, "quiet_at_start": True, "date": "2026-11-26T22:45:44Z"}]
    (tmp_path / "measure.json").write_text(json.dumps({"meta": {"bench": "measure"}, "rows": runs}))
    return [*files, str(tmp_path / "gamma.json"), str(tmp_path / "measure.json")]


def test_command_on_a_fixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unidist.bench.__main__ import main

    out = tmp_path / "model.json"
    assert main(["model", *_fixture(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for heading in ("### Measurement runs", "| mpi-2 | 2026-11-26T22:45:44Z | 24 | 0.40 | 1.90 | yes | 0 |",
                    "### Fitted parameters", "### Prediction against measurement", "### Worst error",
                    "InfiniBand HDR-like", "10 Gb/s Ethernet", "this machine: mpi (mpich), fitted"):
        assert heading in text
    assert "| mpi (mpich) | 4 | 40 of 40 | 0% |" in text  # formulas in, formulas out
    doc = json.loads(out.read_text())
    assert max(abs(r["error"]) for r in doc["checks"]) < 1e-6
    assert doc["params"]["mpi (mpich)"]["links"]["allreduce"]["alpha"] == pytest.approx(6e-6)
    proj = doc["projection"]["InfiniBand HDR-like (25 GB/s per link, 5 us)"]["ResNet-50"]
    assert set(proj) == {str(2 ** k) for k in range(3, 11)}
    # 1024 ranks, 5 us: the ring's 2(p-1) latencies per bucket cost more than Rabenseifner's 2 log2 p
    assert proj["1024"]["ring"] > proj["1024"]["rabenseifner"]
    assert main(["model", *_fixture(tmp_path), "--column", "unidist", "--fit-ranks", "all"]) == 0
    assert "within 25%" in capsys.readouterr().out


def test_cli_dispatches_model_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unidist.bench import OFFLINE
    from unidist.cli import main

    assert "model" in OFFLINE
    assert main(["bench", "model", "--", *_fixture(tmp_path)]) == 0
    assert "### Projected gradient sync" in capsys.readouterr().out


def test_gamma_keeps_the_fastest_of_this_hosts_measurements(tmp_path: Path) -> None:
    import platform

    from unidist.bench.model_measure import fastest

    old = tmp_path / "gamma.json"
    new = [{"bench": "gamma", "bytes": 1024, "seconds": 2.0}, {"bench": "gamma", "bytes": 4096, "seconds": 1.0}]
    assert fastest(new, old) == new  # nothing before
    old.write_text(json.dumps({"meta": {"host": platform.node()}, "rows": [{"bytes": 1024, "seconds": 1.5},
                                                                          {"bytes": 4096, "seconds": 3.0}]}))
    assert [r["seconds"] for r in fastest(new, old)] == [1.5, 1.0]
    old.write_text(json.dumps({"meta": {"host": "elsewhere"}, "rows": [{"bytes": 1024, "seconds": 0.1}]}))
    assert fastest(new, old) == new


def test_wait_quiet_gives_up_after_its_limit() -> None:
    from unidist.bench.model_measure import wait_quiet

    assert wait_quiet(0.0, samples=1) in (True, False)  # one look, no waiting beyond it


def test_projection_counts_buckets() -> None:
    from unidist.bench.model import BUCKET, project

    link = cm.Link(1e-6, 1e-10)
    p = cm.Params({"allreduce": link}, 0.0, 0.0)
    one = project(p, BUCKET, 8)["ring"]
    assert project(p, 2.5 * BUCKET, 8)["ring"] == pytest.approx(2.5 * one + 0.5 * 14e-6)  # 3 calls' latency
    assert math.isclose(one, 14e-6 + 2 * 7 / 8 * BUCKET * 1e-10)


def test_errors_say_how_to_fix(tmp_path: Path) -> None:
    from unidist.bench.__main__ import main

    with pytest.raises(InvalidArgumentError, match="--measure"):
        main(["model"])
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {"backend": "mpi", "launcher": "mpich", "ranks": 2}, "rows": []}))
    with pytest.raises(InvalidArgumentError, match="collectives --compare --json"):
        main(["model", str(empty)])
    files = _fixture(tmp_path)
    with pytest.raises(InvalidArgumentError, match="no rows at"):
        main(["model", *files, "--fit-ranks", "5"])
