"""``unidist verify``'s comparison and report (unidist/verify/compare.py, report.py) on synthetic fingerprints.

No process is started: fingerprint files are written here (the format of unidist/train/fingerprint.py: a header
line, then one line per optimizer step) with one planted difference each, and every expected figure (relative
differences, the step, the parameter, the tolerance of each precision as the docs state it) is computed here from
the planted numbers, not by calling the code under test. The real launches are tests/multiproc/test_verify.py's.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from unidist.errors import InvalidArgumentError
from unidist.verify import compare, report
from unidist.verify.launches import Launch, Outcome

HEADER: dict[str, Any] = {"unidist_fingerprint": 1, "backend": "local", "world": 1, "dp": 1, "zero_stage": 0,
                          "precision": "32", "clip": None, "accumulation": 1}
# a small model: one big weight and a small bias (a change confined to the bias must still be seen)
PARAMS: dict[str, list[float]] = {"0.weight": [3.0, -4.0], "0.bias": [1.0, 0.5], "2.bias": [0.2, 0.1]}
# the tolerance of each precision, as `unidist verify --help` and the docs state them; anything else is float32's
DOCUMENTED = {"32": 1e-4, "bf16-mixed": 5e-2, "fp16-mixed": 2e-2, "bf16-true": 1e-1}
# a phrase of each known cause, to tell which fired
CAUSE_KEYS = {"precision": "precision mode", "clip": "clips the gradient norm", "accumulation": "different "
              "accumulation", "rows": "effective batch", "order": "data order", "skipped": "fp16 overflow",
              "lr": "learning rates", "weights": "starting weights", "nondeterministic": "nondeterministic"}


def _step(i: int) -> dict[str, Any]:
    """Step ``i`` of the reference run: every figure distinct per step."""
    params = {n: [norm * (1 + 0.01 * i), s + 0.01 * i] for n, (norm, s) in PARAMS.items()}
    return {"step": i, "loss": 2.0 / i, "grad_norm": 1.5 / i, "param_norm": math.sqrt(sum(v[0] ** 2
            for v in params.values())), "param_sum": sum(v[1] for v in params.values()), "lr": [0.01],
            "loss_scale": 1.0, "skipped": False, "rows": 16, "inputs": 3.25 + i, "passes": 1.0, "params": params}


def _write(path: Path, header: dict[str, Any] | None, steps: list[dict[str, Any]]) -> Path:
    lines = ([json.dumps(header)] if header is not None else []) + [json.dumps(s, allow_nan=True) for s in steps]
    path.write_text("\n".join(lines) + "\n")
    return path


def _steps(n: int = 6) -> list[dict[str, Any]]:
    return [_step(i) for i in range(1, n + 1)]


def _run(tmp_path: Path, label: str, steps: list[dict[str, Any]], **header: Any) -> compare.Run:
    """Written to a file and read back as unidist verify reads it."""
    return compare.read(_write(tmp_path / f"{label}.jsonl", {**HEADER, **header}, steps), label)


def _pair(tmp_path: Path, edit: dict[int, dict[str, Any]], n: int = 6, ref_header: dict[str, Any] | None = None,
          **header: Any) -> tuple[compare.Run, compare.Run]:
    """(launch, reference): the launch is the reference with ``edit[step]``'s fields replaced."""
    steps = _steps(n)
    mine = copy.deepcopy(steps)
    for i, fields in edit.items():
        mine[i - 1].update(fields)
    ref = _run(tmp_path, "python", steps, **(ref_header or {}))
    return _run(tmp_path, "launch", mine, **header), ref


def _keys(causes: list[str]) -> set[str]:
    return {k for k, phrase in CAUSE_KEYS.items() if any(phrase in c for c in causes)}


# ---------------------------------------------------------------------------------------------- reading
def test_read_gives_the_header_and_every_step(tmp_path: Path) -> None:
    path = _write(tmp_path / "f.jsonl", HEADER, _steps(3))
    path.write_text(path.read_text() + "\n\n")  # blank lines (a file still being written) are skipped
    run = compare.read(path, "x")
    assert run.label == "x" and run.header == HEADER
    assert [s["step"] for s in run.steps] == [1, 2, 3] and run.steps[1] == _step(2)


@pytest.mark.parametrize("content", ["", "\n", json.dumps(_step(1)) + "\n", '{"backend": "local"}\n'])
def test_read_refuses_a_file_without_the_header(tmp_path: Path, content: str) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match="not a unidist fingerprint"):
        compare.read(path, "x")


# ---------------------------------------------------------------------------------------------- tolerance
@pytest.mark.parametrize("precision", [*DOCUMENTED, None, "unknown-mode"])
def test_the_tolerance_follows_the_reference_precision(tmp_path: Path, precision: str | None) -> None:
    """A loss difference just inside the precision's tolerance agrees; just outside it diverges, at that step."""
    tol = DOCUMENTED.get(precision or "32", DOCUMENTED["32"])
    header: dict[str, Any] = {} if precision is None else {"precision": precision}
    ref_loss = _step(2)["loss"]
    for factor, diverges in ((0.9, False), (1.1, True)):
        run, ref = _pair(tmp_path, {2: {"loss": ref_loss * (1 + factor * tol)}}, ref_header=header, **header)
        if precision is None:
            del ref.header["precision"], run.header["precision"]
        assert compare.tolerance(ref) == pytest.approx(tol)
        found = compare.compare(run, ref, compare.tolerance(ref))
        if not diverges:
            assert found is None, found
            continue
        assert found is not None and (found.step, found.quantity, found.param) == (2, "loss", None), found
        assert found.value == pytest.approx(factor * tol, rel=1e-9)
    assert compare.tolerance(ref, 0.25) == 0.25  # --tolerance wins


def test_identical_runs_agree_with_zero_differences(tmp_path: Path) -> None:
    run, ref = _pair(tmp_path, {})
    assert compare.compare(run, ref, 0.0) is None
    diffs = compare.step_diffs(run, ref)
    assert [d.step for d in diffs] == [1, 2, 3, 4, 5, 6]
    assert all((d.loss, d.grad_norm, d.params) == (0.0, 0.0, 0.0) for d in diffs), diffs
    assert compare.worst(diffs) == {"loss": 0.0, "grad_norm": 0.0, "params": 0.0}


# ---------------------------------------------------------------------------------------------- where it diverges
def test_the_first_step_out_of_tolerance_is_named_with_its_quantity_and_value(tmp_path: Path) -> None:
    g3, l5 = _step(3)["grad_norm"], _step(5)["loss"]
    run, ref = _pair(tmp_path, {2: {"loss": _step(2)["loss"] * (1 + 5e-5)},  # inside 1e-4
                                3: {"grad_norm": g3 + 3e-4 * g3}, 5: {"loss": 2 * l5}})
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and (found.step, found.quantity, found.param) == (3, "grad_norm", None), found
    assert found.value == pytest.approx(3e-4, rel=1e-9)
    diffs = compare.step_diffs(run, ref)
    assert diffs[1].loss == pytest.approx(5e-5, rel=1e-6) and diffs[4].loss == pytest.approx(1.0)
    worst = compare.worst(diffs)
    assert worst["loss"] == pytest.approx(1.0) and worst["grad_norm"] == pytest.approx(3e-4, rel=1e-9)


def test_a_change_in_one_small_parameter_is_named(tmp_path: Path) -> None:
    """2e-4 more in the sum of the small bias: 1e-3 of its own norm (out of tolerance), 6e-5 of the whole model's
    (which would have hidden it)."""
    ref_params = _step(1)["params"]
    params = copy.deepcopy(ref_params)
    params["2.bias"][1] += 2e-4
    params["0.weight"][0] *= 1 + 5e-5  # inside the tolerance
    run, ref = _pair(tmp_path, {1: {"params": params}})
    found = compare.compare(run, ref, 1e-4)
    expected = 2e-4 / ref_params["2.bias"][0]
    whole = math.sqrt(sum(v[0] ** 2 for v in ref_params.values()))
    assert 2e-4 / whole < 1e-4 < expected
    assert found is not None and (found.step, found.quantity, found.param) == (1, "params", "2.bias"), found
    assert found.value == pytest.approx(expected, rel=1e-6)


def test_a_parameter_missing_from_the_launch_is_an_infinite_difference(tmp_path: Path) -> None:
    params = copy.deepcopy(_step(1)["params"])
    del params["0.bias"]
    run, ref = _pair(tmp_path, {1: {"params": params}})
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and (found.step, found.quantity, found.param) == (1, "params", "0.bias"), found
    assert found.value == math.inf


def test_a_parameter_only_the_launch_has_is_a_difference(tmp_path: Path) -> None:
    params = {**copy.deepcopy(_step(1)["params"]), "3.extra": [0.5, 0.5]}
    run, ref = _pair(tmp_path, {1: {"params": params}})
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and (found.step, found.quantity) == (1, "params"), found


@pytest.mark.parametrize(("edit", "quantity"), [
    ({"rows": 32, "skipped": True, "loss": 9.0, "grad_norm": 9.0}, "rows"),  # rows before everything
    ({"skipped": True, "loss": 9.0, "grad_norm": None}, "skipped"),  # skipped before the figures
    ({"loss": 9.0, "grad_norm": 9.0}, "loss"),
    ({"grad_norm": 9.0, "params": {n: [v[0] * 2, v[1]] for n, v in _step(2)["params"].items()}}, "grad_norm"),
])
def test_exact_facts_are_checked_before_the_figures(tmp_path: Path, edit: dict[str, Any], quantity: str) -> None:
    run, ref = _pair(tmp_path, {2: edit})
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and (found.step, found.quantity) == (2, quantity), found
    if quantity == "rows":
        assert found.value == 32.0


@pytest.mark.parametrize(("ours", "theirs", "diverges"), [
    (None, None, False),  # neither has a loss (hvd.DistributedOptimizer's fingerprint): not compared
    (None, 1.0, True), (1.0, None, True),  # one has it, the other not
    (math.nan, math.nan, False), (math.inf, math.inf, False),  # the same non-finite value both sides
    (math.inf, 1.0, True), (math.nan, 1.0, True), (1.0, math.inf, True),
])
def test_missing_and_non_finite_losses(tmp_path: Path, ours: float | None, theirs: float | None,
                                       diverges: bool) -> None:
    steps = _steps(2)
    mine = copy.deepcopy(steps)
    steps[0]["loss"], mine[0]["loss"] = theirs, ours
    found = compare.compare(_run(tmp_path, "a", mine), _run(tmp_path, "b", steps), 1e-4)
    if diverges:
        assert found is not None and (found.step, found.quantity, found.value) == (1, "loss", math.inf), found
    else:
        assert found is None, found


@pytest.mark.parametrize(("n", "step"), [(4, 5), (8, 7)])
def test_a_different_number_of_steps_diverges_after_the_last_common_one(tmp_path: Path, n: int, step: int) -> None:
    ref = _run(tmp_path, "ref", _steps(6))
    run = _run(tmp_path, "run", _steps(n))
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and (found.step, found.quantity, found.value) == (step, "steps", float(n)), found
    assert len(found.causes) == 1 and f"made {n} optimizer steps" in found.causes[0] and " 6: " in found.causes[0]
    # a difference inside the common steps is the one reported
    steps = _steps(n)
    steps[1]["loss"] *= 2
    found = compare.compare(_run(tmp_path, "run2", steps), ref, 1e-4)
    assert found is not None and (found.step, found.quantity) == (2, "loss"), found


# ---------------------------------------------------------------------------------------------- causes
CAUSE_CASES: list[tuple[str, int, dict[str, Any], dict[str, Any], str]] = [
    # (cause, step, the launch's fields at that step, the launch's header, the quantity that diverges)
    ("precision", 2, {"loss": 1.5}, {"precision": "bf16-mixed"}, "loss"),
    ("clip", 1, {"params": {n: [v[0] * 0.5, v[1]] for n, v in _step(1)["params"].items()}}, {"clip": 1.0},
     "params"),
    ("accumulation", 2, {"loss": 1.5}, {"accumulation": 2}, "loss"),
    ("rows", 1, {"rows": 32}, {}, "rows"),
    ("order", 1, {"inputs": _step(1)["inputs"] + 0.5, "loss": 2.5}, {}, "loss"),
    ("skipped", 3, {"skipped": True, "grad_norm": None}, {}, "skipped"),
    ("lr", 2, {"lr": [0.02], "grad_norm": 1.0}, {}, "grad_norm"),
    ("weights", 1, {"loss": 2.5}, {}, "loss"),
    ("nondeterministic", 2, {"loss": 1.0 + 1e-3}, {}, "loss"),  # step 2: not the start
    ("nondeterministic", 1, {"grad_norm": 1.6}, {}, "grad_norm"),  # step 1, not the loss
]


@pytest.mark.parametrize(("cause", "step", "edit", "header", "quantity"), CAUSE_CASES,
                         ids=[f"{c[0]}-step{c[1]}" for c in CAUSE_CASES])
def test_each_cause_fires_on_its_own_condition_only(tmp_path: Path, cause: str, step: int, edit: dict[str, Any],
                                                    header: dict[str, Any], quantity: str) -> None:
    run, ref = _pair(tmp_path, {step: edit}, **header)
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and (found.step, found.quantity) == (step, quantity), found
    assert _keys(found.causes) == {cause}, found.causes
    assert len(found.causes) == 1, found.causes


def test_the_causes_say_the_figures(tmp_path: Path) -> None:
    g = _step(1)["grad_norm"]
    run, ref = _pair(tmp_path, {1: {"rows": 24, "lr": [0.5]}}, clip=1.0, accumulation=4, precision="fp16-mixed")
    found = compare.compare(run, ref, 1e-4)
    assert found is not None and _keys(found.causes) == {"precision", "clip", "accumulation", "rows", "lr"}, found
    text = "\n".join(found.causes)
    assert f"clips the gradient norm at 1.0 (the gradient norm at step 1 was {g:.4g}), the reference at None" in text
    assert "'fp16-mixed', the reference in '32'" in text and "4 backward passes a step here, 1 in" in text
    assert "saw 24 rows in step 1, the one-process run 16" in text and "[0.5] here, [0.01] in" in text
    for skipper, who in ((True, "this launch"), (False, "the one-process run")):
        steps = _steps(3)
        mine = copy.deepcopy(steps)
        (mine if skipper else steps)[2].update(skipped=True, grad_norm=None)
        found = compare.compare(_run(tmp_path, "a", mine), _run(tmp_path, "b", steps), 1e-4)
        assert found is not None and len(found.causes) == 1 and f"{who} skipped step 3" in found.causes[0], found


def test_a_batch_digest_moved_by_summation_order_alone_is_not_a_data_order(tmp_path: Path) -> None:
    inputs = _step(1)["inputs"]
    for moved, named in ((inputs * 1e-12, False), (inputs * 1e-4, True)):
        run, ref = _pair(tmp_path, {1: {"inputs": inputs + moved, "loss": 2.5}})
        found = compare.compare(run, ref, 1e-4)
        assert found is not None and ("order" in _keys(found.causes)) is named, found


# ---------------------------------------------------------------------------------------------- the report
def _outcome(tmp_path: Path, label: str, steps: list[dict[str, Any]] | None, code: int = 0, tail: str = "",
             header: dict[str, Any] | None = None, argv: list[str] | None = None) -> Outcome:
    path = tmp_path / f"{label}.jsonl"
    if steps is not None:
        _write(path, {**HEADER, **(header or {})}, steps)
    return Outcome(Launch(label, argv or ["mpiexec", "-n", "2", "python", "s.py"], {"X": "1"}), code, path, tail, 1.25)


def _outcomes(tmp_path: Path, n: int = 12) -> list[Outcome]:
    """The reference, a launch that agrees, one that diverges at step 3 (loss x1.5), one that failed."""
    ref = _steps(n)
    close = copy.deepcopy(ref)
    close[4]["grad_norm"] *= 1 + 2e-6
    off = copy.deepcopy(ref)
    off[2]["loss"] *= 1.5
    return [_outcome(tmp_path, "python", ref, argv=["python", "s.py"]), _outcome(tmp_path, "good", close),
            _outcome(tmp_path, "bad", off),
            _outcome(tmp_path, "broken", None, code=1, tail="Traceback (most recent call last):\nRuntimeError: boom")]


def test_build_says_each_launch_status_and_the_verdict(tmp_path: Path) -> None:
    outs = _outcomes(tmp_path)
    result = report.build(outs, None)
    assert result["verdict"] == "failed" and result["reference"] == "python" and result["tolerance"] == 1e-4
    ref, good, bad, broken = result["launches"]
    assert (ref["status"], ref["steps"], ref["precision"]) == ("reference", 12, "32")
    assert (good["status"], good["steps"], good["divergence"]) == ("agrees", 12, None)
    assert good["worst"]["grad_norm"] == pytest.approx(2e-6, rel=1e-6) and good["worst"]["loss"] == 0.0
    assert len(good["diffs"]) == 12 and good["diffs"][4]["step"] == 5
    assert bad["status"] == "diverged"
    assert set(bad["divergence"]) == {"step", "quantity", "value", "param", "causes"}
    assert (bad["divergence"]["step"], bad["divergence"]["quantity"]) == (3, "loss")
    assert bad["divergence"]["value"] == pytest.approx(0.5)
    assert (broken["status"], broken["returncode"], broken["why"]) == ("failed", 1, "failed")
    assert "RuntimeError: boom" in broken["tail"] and "diffs" not in broken
    assert result["loss"]["python"] == [s["loss"] for s in _steps(12)] and "broken" not in result["loss"]
    assert report.build(outs[:3], None)["verdict"] == "diverged"
    assert report.build(outs[:2], None)["verdict"] == "agree"
    assert report.build(outs[:2], 1e-7)["launches"][1]["status"] == "diverged"  # --tolerance below the 2e-6
    assert report.build(outs[:1], None)["verdict"] == "failed"  # nothing to compare with


def test_build_fails_a_launch_that_left_no_fingerprint_or_another_file(tmp_path: Path) -> None:
    ref = _outcome(tmp_path, "python", _steps(3))
    silent = _outcome(tmp_path, "silent", None)  # exit 0, no file: the script never prepared
    other = _outcome(tmp_path, "other", None)
    other.fingerprint.write_text('{"something": "else"}\n')
    result = report.build([ref, silent, other], None)
    assert result["verdict"] == "failed"
    _, s, o = result["launches"]
    assert s["status"] == "failed" and "no fingerprint" in s["why"] and s["returncode"] == 0
    assert o["status"] == "failed" and "not a unidist fingerprint" in o["why"]


def test_build_without_a_reference_compares_nothing(tmp_path: Path) -> None:
    ref = _outcome(tmp_path, "python", None, code=1, tail="ImportError: x")
    result = report.build([ref, _outcome(tmp_path, "launch", _steps(3))], None)
    assert result["verdict"] == "failed" and result["launches"][0]["status"] == "failed"
    assert result["launches"][1]["status"] == "ran" and "divergence" not in result["launches"][1]
    assert any("ImportError: x" in line for line in report.lines(result))


def test_precision_sets_the_report_tolerance(tmp_path: Path) -> None:
    outs = [_outcome(tmp_path, "python", _steps(3), header={"precision": "bf16-mixed"}),
            _outcome(tmp_path, "launch", _steps(3), header={"precision": "bf16-mixed"})]
    assert report.build(outs, None)["tolerance"] == DOCUMENTED["bf16-mixed"]
    assert report.build(outs, 0.5)["tolerance"] == 0.5


def _table(text: list[str]) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text if line.startswith("| ")]


def test_lines_render_the_table_the_divergence_and_the_failure(tmp_path: Path) -> None:
    result = report.build(_outcomes(tmp_path), None)
    text = report.lines(result)
    assert text[0].startswith("unidist verify: 4 launches against python (12 steps, precision 32, tolerance 1.0e-04")
    head, *rows = _table(text)
    cols = [int(c) for c in head[1:-4]]
    # at most 8 sampled steps, evenly: the first and the last among them, gaps differing by at most one
    assert len(cols) == report.COLUMNS == 8 and cols[0] == 1 and cols[-1] == 12, cols
    gaps = [b - a for a, b in itertools.pairwise(cols)]
    assert min(gaps) >= 1 and max(gaps) - min(gaps) <= 1, cols
    assert head[0] == "launch" and head[-4:] == ["loss", "grad norm", "params", "verdict"]
    by_label = {r[0]: r for r in rows}
    assert set(by_label) == {"python", "good", "bad", "broken"}
    assert by_label["python"][-1] == "reference" and by_label["good"][-1] == "agrees"
    assert by_label["bad"][-1] == "diverged at step 3 (loss)" and by_label["broken"][-1] == "failed"
    # a cell is the step's largest difference; step 3 is a sampled column here only if the sampling took it
    cell = dict(zip(cols, by_label["bad"][1:-4], strict=True))
    assert all(cell[c] == ("5.0e-01" if c == 3 else "0") for c in cols), cell
    assert by_label["bad"][-4:-1] == ["5.0e-01", "0", "0"] and by_label["good"][-3] == "2.0e-06"
    assert by_label["broken"][1:-1] == [""] * len(cols) + ["-", "-", "-"]
    joined = "\n".join(text)
    assert "bad: leaves the one-process run at step 3: loss, 5.0e-01" in joined
    assert "  - likely: nondeterministic kernels" in joined
    assert "broken: failed (exit 1): mpiexec -n 2 python s.py" in joined and "  RuntimeError: boom" in joined
    assert text[-1] == "verdict: a launch failed, or nothing could be compared (above)"
    assert report.lines(report.build(_outcomes(tmp_path)[:2], None))[-1] == \
        "verdict: every launch trains the same as one process"


def test_lines_with_few_steps_show_every_step_and_name_the_parameter(tmp_path: Path) -> None:
    steps = _steps(3)
    off = copy.deepcopy(steps)
    off[1]["params"]["0.bias"][1] += 0.3
    outs = [_outcome(tmp_path, "python", steps), _outcome(tmp_path, "p", off)]
    text = report.lines(report.build(outs, None))
    head = _table(text)[0]
    assert head[1:4] == ["1", "2", "3"] and head[4] == "loss"
    expected = 0.3 / steps[1]["params"]["0.bias"][0]
    assert f"p: leaves the one-process run at step 2: params (most: 0.bias), {expected:.1e}" in "\n".join(text)


def test_the_result_is_json_and_renders_again_after_a_round_trip(tmp_path: Path) -> None:
    result = report.build(_outcomes(tmp_path), None)
    again = json.loads(json.dumps(result))
    assert again == json.loads(json.dumps(again))
    assert report.lines(again) == report.lines(result)


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          plans: list[tuple[list[dict[str, Any]] | None, int]], *flags: str, same: bool = False) -> tuple[int, str]:
    """``unidist verify [flags] --launch 'mpiexec -n 2' --launch 'mpiexec -n 3' ... s.py`` with each launch's run
    replaced by writing the planned fingerprint (None: none, as launches.run: an old one removed first) and
    returning the planned exit code: (verify's exit status, its stdout). ``same``: every launch 'mpiexec -n 2',
    the first with a variable of its own."""
    import argparse

    import unidist.verify as verify

    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "s.py"
    script.write_text("")
    texts = [("OMP_NUM_THREADS=1 " if same and i == 0 else "") + f"mpiexec -n {2 if same else i + 2}"
             for i in range(len(plans) - 1)]
    launches = [w for text in texts for w in ("--launch", text)]
    ns = parser.parse_args([*flags, *launches, "--out-dir", str(tmp_path / "fp"), str(script)])
    queue = iter(plans)
    monkeypatch.setenv("UNIDIST_BACKEND", "torch")  # the caller's own: never handed to the launches

    def planned(launch: Launch, path: Path, env: dict[str, str], timeout: float) -> Outcome:
        assert "UNIDIST_BACKEND" not in env or launch.env.get("UNIDIST_BACKEND") == env["UNIDIST_BACKEND"]
        steps, code = next(queue)
        path.unlink(missing_ok=True)
        if steps is not None:
            _write(path, HEADER, steps)
        return Outcome(launch, code, path, "Traceback (most recent call last):\nRuntimeError: planted", 0.5)

    monkeypatch.setattr(verify, "run", planned)
    code = verify.main(ns, lambda *args: [])
    return code, capsys.readouterr().out


def test_the_exit_status_says_agree_diverged_or_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    off = _steps(3)
    off[1]["loss"] *= 2
    Plans = list[tuple[list[dict[str, Any]] | None, int]]
    cases: list[tuple[Plans, int, str]] = [
        ([(_steps(3), 0), (_steps(3), 0)], 0, "agree"), ([(_steps(3), 0), (off, 0)], 1, "diverged"),
        ([(_steps(3), 0), (_steps(3), 0), (None, 1)], 2, "failed"),  # a launch failed
        ([(_steps(3), 0), (None, 0)], 2, "failed"),  # exit 0 and no fingerprint
        ([(None, 1), (_steps(3), 0)], 2, "failed")]  # the reference failed
    for i, (plans, status, verdict) in enumerate(cases):
        code, out = _main(tmp_path / str(i), monkeypatch, capsys, plans, "--json")
        assert (code, json.loads(out)["verdict"]) == (status, verdict), (i, out)
    code, out = _main(tmp_path / "text", monkeypatch, capsys, cases[1][0])
    assert code == 1 and out.splitlines()[-1] == "verdict: a launch trains differently (above)", out
    assert "leaves the one-process run at step 2: loss, 1.0e+00" in out


def test_two_launches_with_the_same_label_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _main(tmp_path, monkeypatch, capsys, [(_steps(3), 0), (None, 1), (_steps(3), 0)], "--json",
                      same=True)
    statuses = [e["status"] for e in json.loads(out)["launches"]]
    assert (code, statuses) == (2, ["reference", "failed", "agrees"]), out


def test_a_missing_script_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    import unidist.verify as verify

    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    assert verify.main(parser.parse_args([str(tmp_path / "absent.py")]), lambda *args: []) == 2
    assert "no script" in capsys.readouterr().err


def _refuse(word: str) -> Any:
    raise ValueError(f"not JSON: {word}")


def test_the_json_is_strict_json_when_a_difference_is_infinite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    off = _steps(3)
    del off[0]["params"]["0.bias"]  # an infinite difference at step 1
    code, out = _main(tmp_path, monkeypatch, capsys, [(_steps(3), 0), (off, 0)], "--json")
    assert code == 1
    result = json.loads(out, parse_constant=_refuse)  # a strict parser: NaN, Infinity, -Infinity refused
    assert result["launches"][1]["divergence"]["quantity"] == "params"


def test_plot_overlays_the_loss_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = report.build(_outcomes(tmp_path, n=5), None)
    png = tmp_path / "curves.png"
    assert report.plot(result, str(png)) == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
