"""``unidist verify``'s judgement on synthetic fingerprints: the envelope (envelope.py), the comparison (compare.py),
the causes (causes.py) and the location (locate.py).

No process is started: fingerprint files are written here in the format of unidist/train/fingerprint.py (a header,
the starting weights as step 0, one line per step, checkpoint events), the one-process run's rounding re-runs
with planted differences, and every expected figure (envelopes, bounds, ratios, steps, names) is computed here
from the planted numbers, not by calling the code under test. The real launches are tests/multiproc/test_verify.py's.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from unidist.errors import InvalidArgumentError
from unidist.verify import compare, envelope, runs
from unidist.verify.causes import Evidence, causes
from unidist.verify.locate import locate

HEADER: dict[str, Any] = {"unidist_fingerprint": 2, "backend": "local", "world": 1, "dp": 1, "zero_stage": 0,
                          "precision": "32", "clip": None, "accumulation": 1, "random": "off"}
# a small model: one big weight, a small bias (a change confined to it must still be seen), a bias that starts at 0
PARAMS: dict[str, list[float]] = {"0.weight": [3.0, -4.0], "0.bias": [1.0, 0.5], "2.bias": [0.2, 0.1]}
FACTOR = 10.0  # the documented default (`unidist verify --help`)
FLOOR = 4 * 2.0**-23  # four float32 epsilons


def _step(i: int) -> dict[str, Any]:
    """Step ``i`` of the reference run: every figure distinct per step; each parameter moves 1% a step."""
    params = {n: [norm * (1 + 0.01 * i), s + 0.01 * i] for n, (norm, s) in PARAMS.items()}
    return {"step": i, "loss": 2.0 / i, "grad_norm": 1.5 / i, "lr": [0.01], "loss_scale": 1.0, "skipped": False,
            "rows": 16, "inputs": 3.25 + i, "digest": 0.5 + i, "passes": 1.0, "params": params}


def _start() -> dict[str, Any]:
    return {"step": 0, "params": copy.deepcopy(PARAMS)}


def _steps(n: int = 6) -> list[dict[str, Any]]:
    return [_step(i) for i in range(1, n + 1)]


def _write(path: Path, header: dict[str, Any] | None, lines: list[dict[str, Any]]) -> Path:
    text = ([json.dumps(header)] if header is not None else []) + [json.dumps(s, allow_nan=True) for s in lines]
    path.write_text("\n".join(text) + "\n")
    return path


def _run(tmp_path: Path, label: str, steps: list[dict[str, Any]], start: dict[str, Any] | None = None,
         events: list[dict[str, Any]] | None = None, **header: Any) -> runs.Run:
    """Written to a file and read back as unidist verify reads it."""
    lines = [start or _start(), *steps, *(events or [])]
    return runs.read(_write(tmp_path / f"{label}.jsonl", {**HEADER, **header}, lines), label)


def _perturbed(tmp_path: Path, k: int, loss: list[float], params: dict[str, list[float]]) -> runs.Run:
    """Rounding re-run ``k``: the reference's steps with the loss moved by ``loss[i]`` (relative) and each named
    parameter's norm by ``params[name][i]`` (relative) at step i+1."""
    steps = _steps(len(loss))
    for i, s in enumerate(steps):
        s["loss"] *= 1 + loss[i]
        for name, moves in params.items():
            s["params"][name][0] *= 1 + moves[i]
    return _run(tmp_path, f"python-rounding{k}", steps)


def _envelope(tmp_path: Path, n: int = 4) -> tuple[runs.Run, envelope.Envelope]:
    """The reference and the envelope of two rounding re-runs with planted moves: the loss by 2e-6, 5e-6, 1e-6,
    ... (run 1) and 1e-6, 3e-6, 4e-6 (run 2); 0.weight by 1e-6 a step; 2.bias by 6e-3 (rounding-driven: training
    moves its sum by 0.01 a step, 5% of its norm at step 1)."""
    ref = _run(tmp_path, "python", _steps(n))
    one = _perturbed(tmp_path, 1, [2e-6, 5e-6, 1e-6, 1e-6][:n], {"0.weight": [1e-6] * n, "2.bias": [6e-3] * n})
    two = _perturbed(tmp_path, 2, [1e-6, 3e-6, 4e-6, 2e-6][:n], {"0.weight": [1e-6] * n})
    return ref, envelope.measure(ref, [one, two], FACTOR)


def _launch(tmp_path: Path, edit: dict[int, dict[str, Any]], n: int = 4, **header: Any) -> runs.Run:
    steps = _steps(n)
    for i, fields in edit.items():
        steps[i - 1].update(copy.deepcopy(fields))
    return _run(tmp_path, "launch", steps, **header)


def _params(step: int, **moves: float) -> dict[str, list[float]]:
    """Step ``step``'s parameters with each named one's norm moved by the given relative amount."""
    params = copy.deepcopy(_step(step)["params"])
    for name, move in moves.items():
        params[name.replace("_", ".")][0] *= 1 + move
    return params


# ---------------------------------------------------------------------------------------------- reading
def test_read_gives_the_header_the_start_the_steps_and_the_events(tmp_path: Path) -> None:
    events = [{"event": "save", "path": "/x/ck-2", "after_step": 2}, {"event": "load", "path": "/x/ck-1",
                                                                       "after_step": 0}]
    run = _run(tmp_path, "x", _steps(3), events=events)
    assert run.label == "x" and run.header["precision"] == "32" and run.precision == "32"
    assert run.start == _start() and [s["step"] for s in run.steps] == [1, 2, 3]
    assert run.saves() == events[:1] and run.loads() == events[1:]
    old = _write(tmp_path / "old.jsonl", {**HEADER, "unidist_fingerprint": 1}, _steps(2))  # format 1: no start
    assert runs.read(old, "o").start is None and len(runs.read(old, "o").steps) == 2


@pytest.mark.parametrize("content", ["", "\n", json.dumps(_step(1)) + "\n", '{"backend": "local"}\n',
                                     '{"unidist_fingerprint": 99}\n'])
def test_read_refuses_a_file_without_the_header(tmp_path: Path, content: str) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match="not a unidist fingerprint"):
        runs.read(path, "x")


def test_random_calls_add_up_over_the_steps_and_group_by_op(tmp_path: Path) -> None:
    steps = _steps(2)
    steps[0]["random"] = {"drop:dropout": 2, "attn:scaled_dot_product_attention": 1}
    steps[1]["random"] = {"drop:dropout": 2, "(outside the model):randperm": 1}
    run = _run(tmp_path, "x", steps)
    calls = run.random_calls()
    assert calls == {"drop:dropout": 4, "attn:scaled_dot_product_attention": 1, "(outside the model):randperm": 1}
    assert runs.sites(calls)["dropout"] == {"drop": 4}


# ---------------------------------------------------------------------------------------------- the envelope
def test_the_envelope_is_the_running_max_over_the_rounding_runs(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    assert env.runs == 2 and env.factor == FACTOR and env.floor == pytest.approx(FLOOR)
    # loss: max(2e-6, 1e-6)=2e-6, max(5e-6, 3e-6)=5e-6, then max(1e-6, 4e-6)=4e-6 < 5e-6 so 5e-6 stays, 5e-6
    assert env.loss == pytest.approx([2e-6, 5e-6, 5e-6, 5e-6], rel=1e-6)
    assert env.envelope("params", 0, "0.weight") == pytest.approx(1e-6, rel=1e-6)
    assert env.envelope("params", 0, "0.bias") == 0.0  # no run moved it
    assert env.bound("loss", 1) == pytest.approx(FACTOR * 5e-6, rel=1e-6)
    assert env.bound("params", 0, "0.bias") == pytest.approx(FACTOR * FLOOR)  # the floor
    assert env.bound("grad_norm", 0) == pytest.approx(FACTOR * FLOOR)  # the grad norm never moved
    fixed = envelope.measure(ref, [], FACTOR, fixed=1e-3)
    assert fixed.bound("loss", 0) == fixed.bound("params", 2, "0.weight") == 1e-3 and fixed.runs == 0


def test_the_floor_follows_the_dtype_of_the_parameters(tmp_path: Path) -> None:
    ref = _run(tmp_path, "python", _steps(2), precision="bf16-true")
    assert envelope.measure(ref, [], FACTOR).floor == pytest.approx(4 * 2.0**-7)
    assert envelope.measure(_run(tmp_path, "p", _steps(2), precision="bf16-mixed"), [], FACTOR).floor == \
        pytest.approx(FLOOR)


def test_a_parameter_is_rounding_driven_when_rounding_moves_it_a_tenth_as_far_as_training(tmp_path: Path) -> None:
    _, env = _envelope(tmp_path)
    # 2.bias: training moves its sum 0.01 a step (its norm 0.2 -> 0.202 at step 1: 0.01/0.202), rounding 6e-3
    moved = 0.01 / 0.202
    assert env.moved[0]["2.bias"] == pytest.approx(moved, rel=1e-6)
    assert 6e-3 >= envelope.NOISE_SHARE * moved and env.rounding_driven("2.bias", 0)
    assert not env.rounding_driven("2.bias", 3)  # by step 4 training moved it 0.04: rounding is under a tenth
    assert not env.rounding_driven("0.weight", 0)  # 1e-6 against 1e-2
    assert not env.rounding_driven("0.bias", 0)  # never above the floor


# ---------------------------------------------------------------------------------------------- comparing
def test_a_launch_within_the_bound_agrees_and_one_beyond_diverges_there(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    loss2 = _step(2)["loss"]
    inside = _launch(tmp_path, {2: {"loss": loss2 * (1 + 0.9 * FACTOR * 5e-6)}})
    assert compare.compare(inside, ref, env) is None
    beyond = _launch(tmp_path, {2: {"loss": loss2 * (1 + 1.1 * FACTOR * 5e-6)}})
    found = compare.compare(beyond, ref, env)
    assert found is not None and (found.step, found.quantity, found.param) == (2, "loss", None), found
    assert found.value == pytest.approx(1.1 * FACTOR * 5e-6, rel=1e-6)
    assert found.bound == pytest.approx(FACTOR * 5e-6, rel=1e-6)
    diffs = compare.step_diffs(beyond, ref, env)
    assert diffs[1].ratio == pytest.approx(1.1, rel=1e-6) and diffs[0].ratio == 0.0


def test_each_parameter_has_its_own_bound(tmp_path: Path) -> None:
    """0.weight moves 5e-6 (inside 10 x its 1e-6); 0.bias moves as much, beyond its floor bound (no rounding
    run moved it): the bias is named."""
    ref, env = _envelope(tmp_path)
    run = _launch(tmp_path, {1: {"params": _params(1, **{"0_weight": 5e-6, "0_bias": 5e-6})}})
    found = compare.compare(run, ref, env)
    assert found is not None and (found.step, found.quantity, found.param) == (1, "params", "0.bias"), found
    assert found.value == pytest.approx(5e-6, rel=1e-3) and found.bound == pytest.approx(FACTOR * FLOOR)


def test_a_rounding_driven_parameter_is_listed_and_cannot_decide_alone(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    bound = FACTOR * 6e-3
    run = _launch(tmp_path, {1: {"params": _params(1, **{"2_bias": 2 * bound})}})
    assert compare.compare(run, ref, env) is None
    diffs = compare.step_diffs(run, ref, env)
    assert diffs[0].noise == ["2.bias"] and diffs[0].param != "2.bias"
    # the same difference, once the envelope is fixed (--tolerance: no rounding runs, nothing rounding-driven)
    fixed = envelope.measure(ref, [], FACTOR, fixed=1e-4)
    found = compare.compare(run, ref, fixed)
    assert found is not None and found.param == "2.bias"


@pytest.mark.parametrize(("edit", "quantity"), [
    ({"rows": 32, "digest": 9.0, "skipped": True, "loss": 9.0}, "rows"),  # rows before everything
    ({"digest": 9.0, "skipped": True, "loss": 9.0}, "data"),  # other rows, as many
    ({"skipped": True, "loss": 9.0, "grad_norm": None}, "skipped"),
    ({"lr": [0.02], "loss": 9.0}, "lr"),
    ({"loss": 9.0, "grad_norm": 9.0}, "loss"),  # then the figures, in the order a step computes them
    ({"grad_norm": 9.0, "params": {n: [v[0] * 2, v[1]] for n, v in _step(2)["params"].items()}}, "grad_norm"),
])
def test_exact_facts_come_before_the_figures(tmp_path: Path, edit: dict[str, Any], quantity: str) -> None:
    ref, env = _envelope(tmp_path)
    found = compare.compare(_launch(tmp_path, {2: edit}), ref, env)
    assert found is not None and (found.step, found.quantity) == (2, quantity), found


def test_a_digest_moved_by_summation_order_alone_is_the_same_data(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    assert compare.compare(_launch(tmp_path, {1: {"digest": 1.5 + 1e-12}}), ref, env) is None
    old = {k: v for k, v in _step(1).items() if k != "digest"}  # format 1: the plain sum decides
    assert compare.data_differs({**old, "inputs": old["inputs"] * (1 + 1e-4)}, old)
    assert not compare.data_differs({**old, "inputs": old["inputs"] * (1 + 1e-12)}, old)


def test_clipping_diverges_only_where_it_changes_the_step(tmp_path: Path) -> None:
    """The launch clips at 1.0, the reference never: step 1's norm 1.5 is clipped (coefficient 1/1.5), steps 2-4's
    (0.75, 0.5, 0.375) are not."""
    ref, env = _envelope(tmp_path)
    found = compare.compare(_launch(tmp_path, {}, clip=1.0), ref, env)
    assert found is not None and (found.step, found.quantity) == (1, "clipping"), found
    assert found.value == pytest.approx(1 / 3, rel=1e-9)  # the coefficient 1/1.5 against the reference's 1
    later = _launch(tmp_path, {1: {"grad_norm": 0.9}}, clip=1.0)
    ref_low = _run(tmp_path, "python", [{**_step(1), "grad_norm": 0.9}, *_steps(4)[1:]])
    assert compare.compare(later, ref_low, envelope.measure(ref_low, [], FACTOR)) is None


def test_different_starting_weights_diverge_before_the_first_step(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    start = _start()
    start["params"]["0.bias"][1] += 0.1
    run = _run(tmp_path, "launch", _steps(4), start=start)
    found = compare.compare(run, ref, env)
    assert found is not None and (found.step, found.quantity, found.param) == (0, "start", "0.bias"), found


@pytest.mark.parametrize(("n", "step"), [(2, 3), (6, 5)])
def test_a_different_number_of_steps_diverges_after_the_last_common_one(tmp_path: Path, n: int, step: int) -> None:
    ref, env = _envelope(tmp_path)
    found = compare.compare(_launch(tmp_path, {}, n=n), ref, env)
    assert found is not None and (found.step, found.quantity, found.value) == (step, "steps", float(n)), found


def test_missing_and_infinite_parameters_are_beyond_any_bound(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    params = _params(1)
    del params["0.bias"]
    found = compare.compare(_launch(tmp_path, {1: {"params": params}}), ref, env)
    assert found is not None and (found.param, found.value) == ("0.bias", math.inf), found
    worst = compare.worst(compare.step_diffs(_launch(tmp_path, {1: {"loss": math.inf}}), ref, env))
    assert worst["loss"]["value"] == math.inf and worst["ratio"] == math.inf


# ---------------------------------------------------------------------------------------------- causes
def _causes(run: runs.Run, ref: runs.Run, env: envelope.Envelope, ev: Evidence | None = None,
            **kwargs: Any) -> list[str]:
    found = compare.compare(run, ref, env)
    assert found is not None
    return causes(run, ref, found, env, compare.step_diffs(run, ref, env), ev or Evidence(), **kwargs)


def test_nondeterminism_is_named_only_when_a_second_run_differs(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    run = _launch(tmp_path, {3: {"loss": 3.0}})
    silent = _causes(run, ref, env)
    assert not any("nondeterministic kernels" in c for c in silent) and "not re-run" in silent[-1]
    repeat = _causes(run, ref, env, Evidence(rerun={"launch": (0.0, 0.0)}))
    assert "repeats its first exactly" in repeat[-1] and not any("nondeterministic kernels" in c for c in repeat)
    within = _causes(run, ref, env, Evidence(rerun={"launch": (1e-7, 0.3)}))  # probes' reordering: rounding
    assert "repeats its first within rounding (0.3 of the bound)" in within[-1], within
    differs = _causes(run, ref, env, Evidence(rerun={"launch": (2e-3, 40.0)}))
    assert any(c.startswith("nondeterministic kernels: a second run of this launch differs from its first by 0.002 "
                            "(relative; 40 times the rounding bound)") for c in differs), differs


def test_starts_small_and_grows_only_when_it_does(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    loss = [_step(i)["loss"] for i in range(1, 5)]
    # 0.1, 0.6, then 1.5 bounds: grows from within the bound
    growing = _launch(tmp_path, {1: {"loss": loss[0] * (1 + 0.1 * FACTOR * 2e-6)},
                                 2: {"loss": loss[1] * (1 + 0.6 * FACTOR * 5e-6)},
                                 3: {"loss": loss[2] * (1 + 1.5 * FACTOR * 5e-6)}})
    said = _causes(growing, ref, env)
    assert any(c.startswith("a difference that starts within rounding and grows: 0.1 of the bound at step 1, "
                            "1.5 at step 3") for c in said), said
    # a jump: within rounding at steps 1 and 2, then 3 bounds at once; and a difference there from step 1 on
    for edit in ({1: {"loss": loss[0] * (1 + 0.1 * FACTOR * 2e-6)}, 2: {"loss": loss[1] * (1 + 0.2 * FACTOR * 5e-6)},
                  3: {"loss": loss[2] * (1 + 3 * FACTOR * 5e-6)}},
                 {1: {"loss": loss[0] * (1 + 0.9 * FACTOR * 2e-6)}, 2: {"loss": loss[1] * (1 + 0.9 * FACTOR * 5e-6)},
                  3: {"loss": loss[2] * (1 + 1.5 * FACTOR * 5e-6)}}):
        assert not any("grows" in c for c in _causes(_launch(tmp_path, edit), ref, env))


def test_the_facts_are_named_with_their_figures(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    said = "\n".join(_causes(_launch(tmp_path, {1: {"rows": 24, "lr": [0.02]}}, clip=1.0, accumulation=4,
                                     precision="fp16-mixed", dp=2), ref, env))
    assert "clips the gradient norm at 1.0 (the gradient norm at step 1 was 1.5), the reference at None" in said
    assert "'fp16-mixed', the reference in '32'" in said and "4 backward passes a step here, 1 in" in said
    assert "saw 24 rows in step 1, the one-process run 16" in said
    assert "[0.02] here, [0.01] in the reference (exactly 2 times, the number of ranks" in said
    other = "\n".join(_causes(_launch(tmp_path, {1: {"lr": [0.03]}}, dp=2), ref, env))
    assert "a schedule or a learning rate that depends on the world size" in other
    data = _causes(_launch(tmp_path, {2: {"digest": 7.0}}), ref, env)
    assert data[0].startswith("a data order that depends on the rank or the world size: the rows of step 2")


def test_a_loaded_checkpoint_comes_first_with_the_launch_that_wrote_it(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    run = _launch(tmp_path, {2: {"loss": 3.0}})
    run.events = [{"event": "load", "path": "/w/ckpt/epoch-003", "after_step": 0}]
    said = _causes(run, ref, env, Evidence(writers={"launch": {"/w/ckpt/epoch-003": "python"}}))
    assert said[0].startswith("this launch resumed from a checkpoint: it loaded /w/ckpt/epoch-003 after 0 steps, "
                              "which the launch python wrote earlier in this verify"), said
    ref.events = list(run.events)  # both loaded the same one: not a cause
    assert not any("resumed" in c for c in _causes(run, ref, env))


def test_random_ops_are_named_by_site_and_op(tmp_path: Path) -> None:
    ref, env = _envelope(tmp_path)
    steps = _steps(4)
    steps[0]["loss"] = 3.0
    steps[0]["random"] = {"h.0.drop:dropout": 3, "h.0.attn:scaled_dot_product_attention": 1,
                          "(outside the model):random_": 1}
    kept = _run(tmp_path, "launch", steps, random="count")
    said = _causes(kept, ref, env)
    assert said[0].startswith("random ops that draw different numbers at different world sizes: dropout at h.0.drop "
                              "(3 calls); scaled_dot_product_attention at h.0.attn (1 calls); they"), said
    assert said[0].endswith("they run as written here (--keep-random)")
    # dropout switched off: only what was not switched off is a cause
    steps[0]["random"] = {"h.0.drop:dropout": 3, "noise:randn_like": 2}
    off = _run(tmp_path, "launch", steps, random="off")
    said = _causes(off, ref, env)
    assert said[0].startswith("random ops that draw different numbers at different world sizes: randn_like at "
                              "noise (2 calls)"), said


def test_launches_that_agree_with_each_other_and_all_leave_at_step_1_say_so_first(tmp_path: Path) -> None:
    ref = _run(tmp_path, "python", _steps(4), precision="bf16-mixed")
    env = envelope.measure(ref, [], FACTOR)
    run = _launch(tmp_path, {1: {"loss": 2.5}}, precision="bf16-mixed")
    said = _causes(run, ref, env, Evidence(peers_agree=True))
    assert said[0].startswith("every launch agrees with the others and all leave the one-process run at step 1: "
                              "what differs is one process against N ranks: a batch split under bf16-mixed"), said


def test_a_location_gives_the_phase_its_cause(tmp_path: Path) -> None:
    from unidist.verify.locate import Location

    ref, env = _envelope(tmp_path)
    run = _launch(tmp_path, {1: {"params": _params(1, **{"0_weight": 1e-3})}})
    where = Location(1, "optimizer step", "0.weight", 1e-3, 1e-5, "")
    said = _causes(run, ref, env, Evidence(rerun={"launch": (0.0, 0.0)}), location=where)
    assert said == ["an optimizer setting that depends on the world size: every gradient, the clipping and the "
                    "learning rates agree at step 1, and the step moves 0.weight otherwise (a weight decay, a "
                    "momentum or betas scaled by the ranks, or another optimizer)"]


# ---------------------------------------------------------------------------------------------- locate
def _probed(step: dict[str, Any], forward: dict[str, list[float]], backward: dict[str, list[float]],
            grads: dict[str, list[float]]) -> dict[str, Any]:
    return {**step, "probes": {"forward": forward, "backward": backward, "grads": grads}}


FORWARD = {"emb": [0.5, 4.0, 64.0], "drop": [0.5, 4.0, 64.0], "head": [1.0, 4.0, 8.0]}  # mean, square, count
BACKWARD = {"head": [0.5, 1.0, 0.0], "drop": [0.2, 0.25, 0.0], "emb": [0.2, 0.25, 0.0]}
GRADS = {"0.weight": [0.3, 0.4, 1.0], "0.bias": [0.1, -0.1, 0.04]}


def _located(tmp_path: Path, forward: dict[str, list[float]] | None = None,
             backward: dict[str, list[float]] | None = None, grads: dict[str, list[float]] | None = None,
             step: dict[str, Any] | None = None, **header: Any) -> Any:
    """Locate a launch's step 1 against the reference and one rounding re-run whose every statistic moved 1e-6."""
    def moved(table: dict[str, list[float]]) -> dict[str, list[float]]:
        return {k: [x * (1 + 1e-6) for x in v] for k, v in table.items()}
    ref = _run(tmp_path, "ref", [_probed(_step(1), FORWARD, BACKWARD, GRADS)])
    pert = _run(tmp_path, "pert", [_probed(_step(1), moved(FORWARD), moved(BACKWARD), moved(GRADS))])
    launch = _run(tmp_path, "launch", [_probed({**_step(1), **(step or {})}, forward or FORWARD,
                                               backward or BACKWARD, grads or GRADS)], **header)
    env = envelope.measure(ref, [pert], FACTOR)
    return locate(launch, ref, [pert], 1, env)


def test_locate_names_the_first_place_in_the_order_the_step_ran(tmp_path: Path) -> None:
    assert _located(tmp_path).phase is None  # identical: nothing leaves
    drop = {**FORWARD, "drop": [0.7, 4.0, 64.0], "head": [9.0, 4.0, 8.0]}  # drop first, head after it
    found = _located(tmp_path, forward=drop)
    assert (found.phase, found.where) == ("forward", "drop"), found
    assert found.value == pytest.approx(0.2 / 2.0) and found.said.startswith("step 1, the forward of drop")
    assert _located(tmp_path, forward={**FORWARD, "emb": [0.5, 4.0, 128.0]}).phase is None  # counts: not compared
    found = _located(tmp_path, backward={**BACKWARD, "drop": [0.2, 0.3, 0.0]})
    assert (found.phase, found.where) == ("backward", "drop"), found
    found = _located(tmp_path, grads={**GRADS, "0.bias": [0.2, -0.1, 0.04]})
    assert (found.phase, found.where) == ("parameter gradients", "0.bias"), found
    assert found.value == pytest.approx(0.1 / 0.2)  # the sum's difference over the gradient's norm
    found = _located(tmp_path, step={"grad_norm": 3.0})
    assert found.phase == "gradient reduction", found
    found = _located(tmp_path, clip=1.0)
    assert found.phase == "clipping", found
    found = _located(tmp_path, step={"lr": [0.02]})
    assert (found.phase, found.where) == ("optimizer step", "learning rates"), found
    found = _located(tmp_path, step={"params": _params(1, **{"0_bias": 1e-3, "0_weight": 1e-4})})
    assert (found.phase, found.where) == ("optimizer step", "0.bias"), found  # the one furthest beyond
    found = _located(tmp_path, step={"digest": 99.0}, forward=drop)
    assert found.phase == "data" and "digest 99" in found.said, found


def test_locate_compares_a_replicated_gradient_by_its_relative_difference(tmp_path: Path) -> None:
    found = _located(tmp_path, backward={**BACKWARD, "emb": [0.2, 0.25, 0.1]})  # the reference has none there
    assert (found.phase, found.where) == ("backward", "emb") and found.value == math.inf, found
    BACKWARD["head"] = [0.5, 1.0, 2.0]
    try:
        found = _located(tmp_path, backward={**BACKWARD, "head": [0.5, 1.0, 2.2]})
    finally:
        BACKWARD["head"] = [0.5, 1.0, 0.0]
    assert (found.phase, found.where) == ("backward", "head") and found.value == pytest.approx(0.1), found
