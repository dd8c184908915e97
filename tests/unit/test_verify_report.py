"""``unidist verify``'s report (report.py), its command line (verify/__init__.py) and the launches' working
directories (workdirs.py), with every launch's run replaced by writing a planned fingerprint.

The judgement itself is tests/unit/test_verify_compare.py's; the real launches are tests/multiproc/test_verify.py's.
Here: which runs verify makes (the reference, its rounding re-runs with the perturbation's seed, each launch, the
re-runs that locate), where (each in a directory of its own), what it prints (the table with each figure beside
its bound, the header, the rounding-driven parameters, causes and locations), and its exit status.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

import unidist.verify as verify
from unidist.verify import report
from unidist.verify.launches import Launch, Outcome
from unidist.verify.workdirs import WORK_DIR, Workdirs, absolute_args

HEADER: dict[str, Any] = {"unidist_fingerprint": 2, "backend": "local", "world": 1, "dp": 1, "zero_stage": 0,
                          "precision": "32", "clip": None, "accumulation": 1, "random": "off"}
PARAMS: dict[str, list[float]] = {"0.weight": [3.0, -4.0], "0.bias": [1.0, 0.5]}
FLOOR_BOUND = 10 * 4 * 2.0**-23  # the default factor times the floor, where the rounding runs moved nothing


def _steps(n: int) -> list[dict[str, Any]]:
    return [{"step": i, "loss": 2.0 / i, "grad_norm": 1.5 / i, "lr": [0.01], "loss_scale": 1.0, "skipped": False,
             "rows": 16, "inputs": 3.0 + i, "digest": 0.5 + i, "passes": 1.0,
             "params": {n_: [v[0] * (1 + 0.01 * i), v[1] + 0.01 * i] for n_, v in PARAMS.items()}}
            for i in range(1, n + 1)]


def _lines(steps: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return None if steps is None else [{"step": 0, "params": copy.deepcopy(PARAMS)}, *steps]


def _outcome(tmp_path: Path, label: str, steps: list[dict[str, Any]] | None, code: int = 0, tail: str = "",
             argv: list[str] | None = None) -> Outcome:
    path = tmp_path / f"{label}.jsonl"
    lines = _lines(steps)
    if lines is not None:
        path.write_text("\n".join(json.dumps(x) for x in [HEADER, *lines]) + "\n")
    return Outcome(Launch(label, argv or ["mpiexec", "-n", "2", "python", "s.py"], {"X": "1"}), code, path, tail, 1.25)


def _outcomes(tmp_path: Path, n: int = 12) -> tuple[list[Outcome], list[Outcome]]:
    """(the reference, a launch that agrees, one that diverges at step 3 (loss x1.5), one that failed), and two
    rounding re-runs that moved the grad norm of step 5 by 2e-6."""
    ref = _steps(n)
    close = copy.deepcopy(ref)
    close[4]["grad_norm"] *= 1 + 2e-6
    off = copy.deepcopy(ref)
    off[2]["loss"] *= 1.5
    rounding = [_outcome(tmp_path, f"python-rounding{k}", close) for k in (1, 2)]
    return [_outcome(tmp_path, "python", ref, argv=["python", "s.py"]), _outcome(tmp_path, "good", close),
            _outcome(tmp_path, "bad", off),
            _outcome(tmp_path, "broken", None, code=1, tail="Traceback (most recent call last):\nRuntimeError: boom")
            ], rounding


def _built(tmp_path: Path, count: int = 4, tolerance: float | None = None) -> dict[str, Any]:
    outs, rounding = _outcomes(tmp_path)
    made = report.build(outs[:count], rounding, tolerance)
    report.explain(made, verify.Evidence(), {})
    return made.result


# ---------------------------------------------------------------------------------------------- the result
def test_build_says_each_launch_status_its_figures_and_the_verdict(tmp_path: Path) -> None:
    result = _built(tmp_path)
    assert result["verdict"] == "failed" and result["reference"] == "python" and result["compared"] == 3
    assert result["envelope"]["runs"] == 2 and result["envelope"]["labels"] == ["python-rounding1", "python-rounding2"]
    ref, good, bad, broken = result["launches"]
    assert (ref["status"], ref["steps"], ref["precision"]) == ("reference", 12, "32")
    assert (good["status"], good["steps"], good["divergence"]) == ("agrees", 12, None)
    # the rounding runs moved step 5's norm by 2e-6 exactly as this launch did: ratio 0.1 of the bound 10 x 2e-6
    assert good["worst"]["grad_norm"]["value"] == pytest.approx(2e-6, rel=1e-6)
    assert good["worst"]["grad_norm"]["bound"] == pytest.approx(2e-5, rel=1e-6)
    assert good["diffs"][4]["ratio"] == pytest.approx(0.1, rel=1e-6)
    assert bad["status"] == "diverged"
    assert (bad["divergence"]["step"], bad["divergence"]["quantity"]) == (3, "loss")
    assert bad["divergence"]["value"] == pytest.approx(0.5) and bad["divergence"]["bound"] == pytest.approx(FLOOR_BOUND)
    assert (broken["status"], broken["returncode"], broken["why"]) == ("failed", 1, "failed")
    assert "RuntimeError: boom" in broken["tail"] and "diffs" not in broken
    assert result["loss"]["python"] == [s["loss"] for s in _steps(12)] and "broken" not in result["loss"]
    assert "python-rounding1" not in result["loss"]
    assert _built(tmp_path, 3)["verdict"] == "diverged" and _built(tmp_path, 2)["verdict"] == "agree"
    assert _built(tmp_path, 1)["verdict"] == "failed"  # nothing to compare with
    fixed = _built(tmp_path, 2, tolerance=1e-7)  # --tolerance below the 2e-6
    assert fixed["launches"][1]["status"] == "diverged" and fixed["envelope"]["fixed"] == 1e-7


def test_build_fails_a_launch_without_a_fingerprint_and_a_reference_that_failed(tmp_path: Path) -> None:
    ref = _outcome(tmp_path, "python", _steps(3))
    silent = _outcome(tmp_path, "silent", None)  # exit 0, no file: the script never prepared
    other = _outcome(tmp_path, "other", None)
    other.fingerprint.write_text('{"something": "else"}\n')
    result = report.build([ref, silent, other], [], None).result
    _, s, o = result["launches"]
    assert result["verdict"] == "failed" and s["status"] == "failed" and "no fingerprint" in s["why"]
    assert o["status"] == "failed" and "not a unidist fingerprint" in o["why"]
    gone = report.build([_outcome(tmp_path, "python", None, code=1, tail="ImportError: x"),
                         _outcome(tmp_path, "launch", _steps(3))], [], None).result
    assert gone["verdict"] == "failed" and gone["launches"][1]["status"] == "ran"
    assert any("ImportError: x" in line for line in report.lines(gone))
    rounding = report.build([ref, _outcome(tmp_path, "launch", _steps(3))],
                            [_outcome(tmp_path, "python-rounding1", None, code=1, tail="boom")], None).result
    assert rounding["verdict"] == "failed" and "python-rounding1 (the one-process run with its rounding perturbed)" \
        in "\n".join(report.lines(rounding))


def _table(text: list[str]) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text if line.startswith("| ")]


def test_lines_show_each_figure_beside_its_bound(tmp_path: Path) -> None:
    result = _built(tmp_path)
    text = report.lines(result)
    assert text[0] == "unidist verify: 3 launches compared with the one-process run (python: 12 steps, precision 32)"
    assert text[1].startswith("bound: 10 x the rounding envelope (how far 2 one-process runs with their rounding "
                              "perturbed land from it, per step and figure), at least 4.8e-07 each")
    assert text[2].startswith("random ops: the dropout family switched off in every launch; seen in the one-process "
                              "run: none")
    head, *rows = _table(text)
    cols = [int(c) for c in head[1:-4]]
    assert len(cols) == report.COLUMNS == 8 and cols[0] == 1 and cols[-1] == 12, cols
    gaps = [b - a for a, b in itertools.pairwise(cols)]
    assert min(gaps) >= 1 and max(gaps) - min(gaps) <= 1, cols
    assert head[-4:] == ["loss (bound)", "grad norm (bound)", "params (bound)", "verdict"]
    by_label = {r[0]: r for r in rows}
    assert by_label["python"][-1] == "reference" and by_label["good"][-1] == "agrees"
    assert by_label["bad"][-1] == "diverged at step 3 (loss)" and by_label["broken"][-1] == "failed"
    assert by_label["good"][-3] == "2.0e-06 (2.0e-05)"  # the grad norm at its worst step, its bound beside it
    ratio = 0.5 / FLOOR_BOUND
    cell = dict(zip(cols, by_label["bad"][1:-4], strict=True))
    assert all(cell[c] == (f"{ratio:.2g}" if c == 3 else "0") for c in cols), cell
    assert by_label["broken"][1:-1] == [""] * len(cols) + ["-", "-", "-"]
    joined = "\n".join(text)
    assert f"bad: leaves the one-process run at step 3: loss, 5.0e-01 against a bound of {FLOOR_BOUND:.1e}" in joined
    assert "  - likely: a computation that differs from one process's beyond rounding" in joined
    assert "broken: failed (exit 1): mpiexec -n 2 python s.py" in joined and "  RuntimeError: boom" in joined
    assert text[-1] == "verdict: a launch failed, or nothing could be compared (above)"
    assert report.lines(_built(tmp_path, 2))[-1] == "verdict: every launch trains the same as one process"


def test_the_result_is_json_and_renders_again_after_a_round_trip(tmp_path: Path) -> None:
    result = _built(tmp_path)
    again = json.loads(json.dumps(result))
    assert report.lines(again) == report.lines(result)


def test_plot_overlays_the_loss_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    assert report.plot(_built(tmp_path), str(png)) == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000


# ---------------------------------------------------------------------------------------------- the command line
Plan = tuple[list[dict[str, Any]] | None, int]


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
          plans: dict[str, Plan], *flags: str, launches: tuple[str, ...] = ("mpiexec -n 2",)
          ) -> tuple[int, str, list[tuple[str, dict[str, str], Path | None]]]:
    """``unidist verify [flags] --launch ... SCRIPT`` with each run replaced by writing the fingerprint planned for
    its label (a rounding or locate re-run: its launch's plan, unless planned itself); the exit status, stdout, and
    every run made: (label, its variables, its working directory)."""
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "s.py"
    script.write_text("")
    argv = [w for text in launches for w in ("--launch", text)]
    ns = parser.parse_args([*flags, *argv, "--out-dir", str(tmp_path / "fp"), str(script)])
    made: list[tuple[str, dict[str, str], Path | None]] = []
    monkeypatch.setenv("UNIDIST_BACKEND", "torch")  # the caller's own: never handed to the launches
    monkeypatch.setenv("UNIDIST_FINGERPRINT_LOCATE", "3")  # nor this

    def planned(launch: Launch, path: Path, env: dict[str, str], timeout: float, cwd: Path | None = None
                ) -> Outcome:
        assert "UNIDIST_BACKEND" not in env and "UNIDIST_FINGERPRINT_LOCATE" not in env
        made.append((launch.label, dict(launch.env), cwd))
        base = launch.label.replace("-locate", "")
        steps, code = plans.get(launch.label) or plans.get(base) or plans[base.split("-rounding")[0]]
        path.unlink(missing_ok=True)
        lines = _lines(steps)
        if lines is not None:
            path.write_text("\n".join(json.dumps(x) for x in [{**HEADER, "random": env.get(
                "UNIDIST_FINGERPRINT_RANDOM")}, *lines]) + "\n")
        return Outcome(launch, code, path, "Traceback (most recent call last):\nRuntimeError: planted", 0.5)

    monkeypatch.setattr(verify, "run", planned)
    monkeypatch.chdir(tmp_path)
    code = verify.main(ns, lambda *args: [])
    return code, capsys.readouterr().out, made


def test_the_runs_verify_makes_and_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data.txt").write_text("rows")
    code, out, made = _main(tmp_path, monkeypatch, capsys, {"python": (_steps(3), 0), "mpiexec-2": (_steps(3), 0)},
                            "--json")
    assert code == 0 and json.loads(out)["verdict"] == "agree", out
    labels = [m[0] for m in made]
    assert labels == ["python", "python-rounding1", "python-rounding2", "mpiexec-2"]
    assert [m[1].get("UNIDIST_FINGERPRINT_PERTURB") for m in made] == [None, "1", "2", None]
    dirs = [m[2] for m in made]
    assert len(set(dirs)) == 4 and all(d is not None and d.parent.parent == tmp_path / WORK_DIR for d in dirs)
    assert not (tmp_path / WORK_DIR).exists()  # removed at the end
    result = json.loads(out)
    assert result["random"]["mode"] == "off" and result["seconds"] >= 0
    _, out, made = _main(tmp_path / "t", monkeypatch, capsys, {"python": (_steps(3), 0), "mpiexec-2": (_steps(3), 0)},
                         "--json", "--tolerance", "1e-3", "--keep-random")
    assert [m[0] for m in made] == ["python", "mpiexec-2"] and json.loads(out)["random"]["mode"] == "count"


def test_a_working_directory_links_the_current_one_and_is_kept_on_request(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data.txt").write_text("rows")
    (tmp_path / "ckpt").mkdir()
    _, _, made = _main(tmp_path, monkeypatch, capsys, {"python": (_steps(2), 0), "mpiexec-2": (_steps(2), 0)},
                       "--keep-workdirs", "--tolerance", "1")
    where = made[1][2]
    assert where is not None and where.is_dir()
    assert (where / "data.txt").read_text() == "rows" and (where / "data.txt").is_symlink()
    assert (where / "ckpt").resolve() == (tmp_path / "ckpt").resolve()
    assert not (where / WORK_DIR).exists() and not (where / "fp").exists()  # verify's own directories: not linked


def test_the_exit_status_says_agree_diverged_or_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    off = _steps(3)
    off[1]["loss"] *= 2
    cases: list[tuple[dict[str, Plan], tuple[str, ...], int, str]] = [
        ({"python": (_steps(3), 0), "mpiexec-2": (_steps(3), 0)}, ("mpiexec -n 2",), 0, "agree"),
        ({"python": (_steps(3), 0), "mpiexec-2": (off, 0)}, ("mpiexec -n 2",), 1, "diverged"),
        ({"python": (_steps(3), 0), "mpiexec-2": (_steps(3), 0), "mpiexec-3": (None, 1)},
         ("mpiexec -n 2", "mpiexec -n 3"), 2, "failed"),
        ({"python": (_steps(3), 0), "mpiexec-2": (None, 0)}, ("mpiexec -n 2",), 2, "failed"),
        ({"python": (None, 1), "mpiexec-2": (_steps(3), 0)}, ("mpiexec -n 2",), 2, "failed")]
    for i, (plans, launches, status, verdict) in enumerate(cases):
        code, out, _ = _main(tmp_path / str(i), monkeypatch, capsys, plans, "--json", "--locate-budget", "0",
                             launches=launches)
        assert (code, json.loads(out)["verdict"]) == (status, verdict), (i, out)


def test_a_divergence_is_located_within_the_budget_or_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    off = _steps(3)
    off[1]["lr"] = [0.02]
    plans: dict[str, Plan] = {"python": (_steps(3), 0), "mpiexec-2": (off, 0)}
    code, out, made = _main(tmp_path, monkeypatch, capsys, plans)  # 4 runs of 0.5 s to repeat: within 120 s
    assert code == 1 and [m[0] for m in made][4:] == ["python-locate", "python-rounding1-locate",
                                                      "python-rounding2-locate", "mpiexec-2-locate"]
    assert [m[1].get("UNIDIST_FINGERPRINT_LOCATE") for m in made][4:] == ["2"] * 4
    assert "  - located: step 2, the optimizer step: the learning rates differ ([0.02] here, [0.01]" in out, out
    _, out, made = _main(tmp_path / "none", monkeypatch, capsys, plans, "--locate-budget", "0")
    assert len(made) == 4 and "located" not in out
    _, out, made = _main(tmp_path / "asked", monkeypatch, capsys, plans, "--locate-budget", "0", "--locate")
    assert len(made) == 8 and "  - located: step 2" in out


def test_a_second_run_that_differs_is_called_nondeterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    off, again = _steps(3), _steps(3)
    off[1]["loss"] *= 2
    again[1]["loss"] *= 3
    plans: dict[str, Plan] = {"python": (_steps(3), 0), "mpiexec-2": (off, 0), "mpiexec-2-locate": (again, 0)}
    code, out, _ = _main(tmp_path, monkeypatch, capsys, plans, "--json")
    causes = json.loads(out)["launches"][1]["divergence"]["causes"]
    assert code == 1 and any(c.startswith("nondeterministic kernels: a second run of this launch differs from its "
                                          "first by 0.5 (relative; ") for c in causes), causes


@pytest.mark.parametrize(("flags", "said"), [
    (("--factor", "0"), "--factor 0.0: give a positive number"),
    (("--tolerance", "-1"), "--tolerance -1.0: give a positive number"),
    (("--locate-budget", "-5"), "--locate-budget -5.0: give a number of seconds"),
    (("-n", "0"), "-n 0: give a number of ranks"),
])
def test_a_bad_option_exits_2_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           flags: tuple[str, ...], said: str) -> None:
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    script = tmp_path / "s.py"
    script.write_text("")
    assert verify.main(parser.parse_args([*flags, str(script)]), lambda *args: []) == 2
    assert said in capsys.readouterr().err
    assert verify.main(parser.parse_args([str(tmp_path / "absent.py")]), lambda *args: []) == 2
    assert "no script" in capsys.readouterr().err


def test_the_json_is_strict_json_when_a_difference_is_infinite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    off = _steps(3)
    del off[0]["params"]["0.bias"]  # an infinite difference at step 1
    code, out, _ = _main(tmp_path, monkeypatch, capsys, {"python": (_steps(3), 0), "mpiexec-2": (off, 0)}, "--json")
    assert code == 1

    def refuse(word: str) -> Any:
        raise ValueError(f"not JSON: {word}")
    result = json.loads(out, parse_constant=refuse)  # a strict parser: NaN, Infinity, -Infinity refused
    assert result["launches"][1]["divergence"]["quantity"] == "params"


# ---------------------------------------------------------------------------------------------- working directories
def test_arguments_that_climb_out_of_the_directory_are_made_absolute(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    args = ["--data", "../shared/x.npz", "--cfg=../cfg.json", "data", "--out", "ckpt", "..", "--lr=0.1"]
    assert absolute_args(args, tmp_path) == [
        "--data", os.path.normpath(tmp_path / "../shared/x.npz"), "--cfg=" + os.path.normpath(tmp_path / "../cfg.json"),
        "data", "--out", "ckpt", str(tmp_path.parent), "--lr=0.1"]


def test_workdirs_fall_back_where_the_directory_is_not_writable(tmp_path: Path) -> None:
    blocked = tmp_path / "ro"
    blocked.mkdir()
    (blocked / WORK_DIR).write_text("a file where the directory would go")
    work = Workdirs(blocked, tmp_path / "out")
    where = work.make("python")
    assert where.is_dir() and (tmp_path / "out") in where.parents
    work.close()
    assert not where.exists()


def test_rounding_driven_parameters_are_listed_with_why_and_where_they_went_beyond(tmp_path: Path) -> None:
    """0.bias: the rounding runs move its norm 5e-3 while training moves it ~1e-2 a step; a launch 10% off there
    (twenty bounds) still agrees, and the report says why."""
    ref = _steps(3)
    rounding, off = copy.deepcopy(ref), copy.deepcopy(ref)
    for s in rounding:
        s["params"]["0.bias"][0] *= 1 + 5e-3
    off[0]["params"]["0.bias"][0] *= 1.1
    made = report.build([_outcome(tmp_path, "python", ref), _outcome(tmp_path, "mpiexec-2", off)],
                        [_outcome(tmp_path, f"python-rounding{k}", rounding) for k in (1, 2)], None)
    report.explain(made, verify.Evidence(), {})
    result = made.result
    assert result["verdict"] == "agree" and result["launches"][1]["noise"] == ["0.bias"], result["launches"][1]
    said = result["noise"]["0.bias"]
    assert said["step"] == 1 and said["envelope"] == pytest.approx(5e-3) and said["beyond"] == ["mpiexec-2"]
    assert said["moved"] == pytest.approx(0.01 / 1.01)
    text = "\n".join(report.lines(result))
    assert "rounding-driven parameters (rounding alone moves them at least a tenth as far as training does" in text
    assert "  - 0.bias: from step 1, rounding moves it 5.0e-03, training moved it 9.9e-03; beyond its bound in " \
           "mpiexec-2" in text
