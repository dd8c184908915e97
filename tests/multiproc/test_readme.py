"""Every command of the README's and the docs' ``<!-- run: launch -->`` blocks runs as written (with this
environment's programs; each distinct command once), and the ``<!-- run: timeline -->`` block's pair in order."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from docsource import commands, output_matches, runnable
from helpers import BIN, ROOT, require, run

COMMANDS = list(dict.fromkeys(cmd for block in runnable("launch") for cmd in commands(block)))


def _engine(cmd: str) -> str | None:
    """The engine the command's launcher (or UNIDIST_BACKEND) needs; script names and options do not count
    (``horovodrun ... examples/deepspeed_digits.py --deepspeed_config ...`` needs Horovod, not DeepSpeed)."""
    if "info --check" in cmd:  # passes when the first launcher found (mpiexec, beside python) works
        return "mpi4py"
    launcher = " ".join(t for t in cmd.split() if not t.startswith(("examples/", "--")))
    for word, engine in (("deepspeed", "deepspeed"), ("horovod", "horovod"), ("mpiexec", "mpi4py")):
        if word in launcher:
            return engine
    return None


def _marks(cmd: str) -> list[pytest.MarkDecorator]:
    engine = _engine(cmd)
    return [{"deepspeed": pytest.mark.deepspeed, "horovod": pytest.mark.horovod, "mpi4py": pytest.mark.mpi}[engine]] \
        if engine else []


def test_block_found() -> None:
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c), id=c[:60]) for c in COMMANDS])
def test_readme_command(cmd: str) -> None:
    engine = _engine(cmd)
    if engine:
        require(engine)
    tokens = shlex.split(cmd)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    tokens = [sys.executable if t == "python" else t for t in tokens]
    tokens = [str(BIN / t.removeprefix(".venv/bin/")) if t.startswith(".venv/bin/") else t  # Quick start's venv
              for t in tokens]
    proc = run(tokens, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.describe()
    count = re.search(r"(?:-n|-np|--nproc_per_node|--num_gpus|\.sh) (\d+)", cmd)
    n = int(count.group(1)) if count else 1
    if cmd.startswith("unidist verify"):  # docs/verify.md: every launch agrees with one process
        assert "verdict: every launch trains the same as one process" in proc.stdout, proc.describe()
        assert len(re.findall(r"^\| \S+ \|.* \| agrees \|$", proc.stdout, flags=re.M)) == cmd.count("--launch"), \
            proc.describe()
        shown = [b.output for b in runnable("launch") if cmd in commands(b) and b.output]
        assert shown and output_matches(shown[0], proc.stdout) is None, output_matches(shown[0], proc.stdout)
    elif "hello_collectives" in cmd:
        assert f"7/7 collectives correct on {n} process(es)" in proc.stdout, proc.describe()
    elif "hybrid_mlp" in cmd:
        assert re.search(r"max \|hybrid - dense\| over every rank's shards after \d+ steps: ", proc.stdout), \
            proc.describe()
    elif "groups.py" in cmd:
        assert f"groups: all checks correct on {n} process(es)" in proc.stdout, proc.describe()
    elif "horovod_digits" in cmd:
        m = re.search(r"horovod_digits: size=(\d) test accuracy ([\d.]+) max parameter difference across ranks (\S+)",
                      proc.stdout)
        assert m, proc.describe()
        assert int(m.group(1)) == n and float(m.group(2)) >= 0.9 and float(m.group(3)) == 0.0, m.group(0)
    elif "deepspeed_digits" in cmd:
        m = re.search(r"deepspeed_digits: size=(\d) steps=(\d+) test accuracy ([\d.]+) max parameter difference "
                      r"across ranks (\S+)", proc.stdout)
        assert m, proc.describe()
        # 1437 rows in micro-batches of 64/2/n per rank: 45 a epoch; an optimizer step every 2 of them (across epochs)
        assert int(m.group(1)) == n and int(m.group(2)) == 3 * 45 // 2, m.group(0)
        assert float(m.group(3)) >= 0.9 and float(m.group(4)) == 0.0, m.group(0)
    elif "train_digits" in cmd:
        m = re.search(r"backend=(\w+) ranks=(\d) final test accuracy ([\d.]+) .* max parameter difference across "
                      r"ranks (\S+)", proc.stdout)
        assert m, proc.describe()
        assert int(m.group(2)) == n
        assert float(m.group(3)) >= 0.9, m.group(0)  # 3 epochs; the full 20-epoch run gives 0.98
        assert float(m.group(4)) == 0.0, m.group(0)  # a broken gradient sync leaves the ranks' models apart
    elif "info --check" in cmd:  # the environment's first launcher (mpiexec beside python) and its engine work
        assert re.search(r"^verdict: mpi works here \(exit 0\)$", proc.stdout, flags=re.M), proc.describe()
    else:
        assert "init() would pick: local" in proc.stdout


TIMELINE = [block.body for block in runnable("timeline")]


@pytest.mark.mpi
def test_readme_timeline_commands(tmp_path: Path) -> None:
    """The Timeline section's commands in order, as written but for their files (in tmp_path: the picture in
    docs/ stays the one the README shows): the README's main job with UNIDIST_TIMELINE set, then the summary
    and the plot of four of its steps."""
    require("mpi4py")
    lines = [line.strip() for line in TIMELINE[0].splitlines() if line.strip()]
    assert len(lines) == 2 and "unidist launch -n 2 examples/train_digits.py" in lines[0]
    trace, png = tmp_path / "digits-trace.json", tmp_path / "timeline.png"
    outputs = []
    for line in lines:
        tokens = shlex.split(line.replace("digits-trace.json", str(trace)).replace("docs/timeline.png", str(png)))
        env = {}
        while re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        proc = run(tokens, env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.describe()
        outputs.append(proc.stdout)
    assert "max parameter difference across ranks 0" in outputs[0], outputs[0]
    summary = outputs[1]
    # MPI reduces the step's bucket at the step (it moves collectives only inside a wait): one allreduce a step,
    # 580 steps, beside the script's own (loss and accuracy means)
    calls = re.search(r"\| allreduce \| world \| (\d+) \|", summary)
    assert calls is not None and int(calls.group(1)) >= 580, summary
    assert "allreduce_prepared" not in summary, summary  # recorded under the collective's name
    assert "Gradient communication hidden behind backward: n/a" in summary and "as MPI" in summary, summary
    assert png.stat().st_size > 10_000
