"""What a ``unidist verify`` run adds to the training fingerprint, in one process: random ops counted and the
dropout family switched off (unidist/train/random_ops.py), rounding injected (rounding.py), per-module probes whose
ranks' shares add up to one process's (probes.py), the starting weights, the batch digest, checkpoint events and the
locate run's stop (fingerprint.py).

Every expectation is computed here with plain torch (the module in eval mode, the batch in halves) or from the
definitions (a float32 epsilon), not by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import unidist
from unidist.train.probes import Probes
from unidist.train.random_ops import OUTSIDE, RandomOps
from unidist.train.rounding import Rounding, gradient_epsilon


class Penalty(nn.Module):
    """A 0-dimensional output, as a loss computed inside a model: each rank's is the mean over its own rows."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).mean()


class Net(nn.Module):
    """Dropout as a module and as a function, attention with dropout_p, MultiheadAttention with dropout, a noise
    draw, a position table broadcast over the rows (a replicated output), a 0-dimensional output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.pos = nn.Embedding(4, 8)
        self.drop = nn.Dropout(0.5)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.penalty = Penalty()

    def forward(self, x: torch.Tensor, noise: bool = False) -> torch.Tensor:
        h = self.drop(self.inp(x)) + self.pos(torch.arange(x.shape[1]))[None]
        h = F.dropout(h, 0.3, training=self.training)
        h = F.scaled_dot_product_attention(h, h, h, dropout_p=0.5 if self.training else 0.0)
        h, _ = self.mha(h, h, h)
        if noise:
            h = h + 0.1 * torch.randn_like(h)
        self.last_penalty = self.penalty(h)  # for the loss: each row's share of it is its own
        return self.head(h).mean(1)  # type: ignore[no-any-return]


def _batch(rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 4, 8, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------- random ops
def test_switched_off_the_dropout_family_is_the_identity() -> None:
    net = Net()
    net.eval()
    expected = net(_batch())
    net.train()
    ops = RandomOps(net, switch_off=True)
    try:
        torch.manual_seed(5)
        got = net(_batch())
        assert torch.equal(got, expected)  # every dropout the identity: what eval computes, bit for bit
        counts = ops.take()
        assert counts == {"drop:dropout": 1, "(model):dropout": 1, "(model):scaled_dot_product_attention": 1,
                          "mha:multi_head_attention_forward": 1} or counts == {
            "drop:dropout": 1, "Net:dropout": 1, "Net:scaled_dot_product_attention": 1,
            "mha:multi_head_attention_forward": 1}, counts
        assert ops.switched == set(counts) and ops.take() == {}  # take() starts counting anew
    finally:
        ops.close()
    torch.manual_seed(5)
    assert not torch.equal(net(_batch()), expected)  # closed: dropout draws again


def test_count_only_leaves_the_draws_as_written_and_names_other_random_ops() -> None:
    net = Net()
    torch.manual_seed(5)
    written = net(_batch(), noise=True)
    ops = RandomOps(net, switch_off=False)
    try:
        torch.manual_seed(5)
        assert torch.equal(net(_batch(), noise=True), written)
        counts = ops.take()
        assert counts[f"{'Net'}:randn_like"] == 1 and counts["drop:dropout"] == 1 and not ops.switched
        torch.randn(3)  # outside the model
        torch.randn(3, generator=torch.Generator())  # its own generator: not the default one, not counted
        assert ops.take() == {f"{OUTSIDE}:randn": 1}
    finally:
        ops.close()


def test_evaluation_and_a_zero_rate_draw_nothing() -> None:
    net = Net()
    ops = RandomOps(net, switch_off=True)
    try:
        net.eval()
        net(_batch())
        F.dropout(torch.ones(3), 0.0, training=True)
        assert ops.take() == {}
    finally:
        ops.close()


# ---------------------------------------------------------------------------------------------- rounding
def test_rounding_moves_outputs_by_at_most_one_epsilon_and_leaves_the_scripts_random_numbers() -> None:
    lin = nn.Linear(16, 16)
    x = torch.randn(64, 16)
    plain = lin(x)
    torch.manual_seed(3)
    before = torch.rand(4)
    moved = Rounding(lin, list(lin.parameters()), seed=1)
    try:
        torch.manual_seed(3)
        out = lin(x)
        assert torch.equal(torch.rand(4), before)  # its own generator: the script's draws are unchanged
    finally:
        moved.close()
    eps = torch.finfo(torch.float32).eps
    rel = ((out - plain).abs() / plain.abs().clamp_min(1e-30)).max()
    assert 0 < rel <= 2 * eps and (out != plain).float().mean() > 0.2  # one epsilon, then the sum's own rounding
    assert torch.equal(lin(x), plain)  # closed


def test_a_gradient_moves_by_its_precisions_epsilon_times_what_it_sums() -> None:
    """A bfloat16-computed gradient moves by bfloat16's epsilon times (its size + the tensor's root mean square): an
    element near zero may change sign, as a partial sum's rounding can make it; an exact zero stays zero."""
    exact = torch.randn(1000).bfloat16().float()
    exact[:10] = torch.tensor(1e-6).bfloat16().float()  # near zero against the tensor's gradients
    exact[10:20] = 0.0  # no gradient at all (an embedding row no token used)
    assert gradient_epsilon(exact) == torch.finfo(torch.bfloat16).eps
    assert gradient_epsilon(torch.randn(1000)) == torch.finfo(torch.float32).eps
    assert gradient_epsilon(torch.randn(1000).half().float()) == torch.finfo(torch.float16).eps
    p = nn.Parameter(torch.ones(1000))
    moved = Rounding(None, [p], seed=2)
    try:
        (p * exact).sum().backward()
    finally:
        moved.close()
    assert p.grad is not None
    eps, rms = torch.finfo(torch.bfloat16).eps, exact.square().mean().sqrt()
    change = (p.grad - exact).abs()
    assert bool((change <= 1.01 * eps * (exact.abs() + rms)).all())
    assert bool((p.grad[10:20] == 0).all()) and bool((p.grad[:10] < 0).any())  # some near-zero ones flipped
    assert (change[20:] / exact[20:].abs()).median() > torch.finfo(torch.float32).eps * 100


# ---------------------------------------------------------------------------------------------- probes
def _probe(rows: torch.Tensor, share: float) -> tuple[Probes, torch.Tensor]:
    net = Net().double()  # float64: the halves' sums then differ from the whole's by 1e-16, not float32's 1e-7
    off = RandomOps(net, switch_off=True)  # dropout off, as verify runs it: halves then compute the same rows
    probes = Probes(net, list(net.named_parameters()), last=1, share=share)
    try:
        loss = net(rows.double()).pow(2).mean() + 1e-3 * net.last_penalty
        loss.backward()
        flat = probes.take(torch.device("cpu"))
        assert flat is not None
        return probes, flat
    finally:
        probes.close()
        off.close()


def test_two_ranks_shares_add_up_to_one_process() -> None:
    """Each half of the batch probed as a rank of two would be (its gradients' share 1/2), the vectors summed as
    the fingerprint's allreduce sums them: one process's statistics. The batch has 4 rows and the sequence 4
    positions, so the position table's output has a first dimension of the rows in one process (and not on a rank
    of two): its forward statistics must not depend on that."""
    batch = _batch()
    probes, whole = _probe(batch, 1.0)
    half, first = _probe(batch[:2], 0.5)
    _, second = _probe(batch[2:], 0.5)
    want, got = probes.line(whole.tolist()), half.line((first + second).tolist())
    for name, (mean, square, _, scalar) in want["forward"].items():
        m, q, _, sc = got["forward"][name]
        assert m == pytest.approx(mean, rel=1e-9, abs=1e-12) and q == pytest.approx(square, rel=1e-9), name
        assert sc == pytest.approx(scalar, rel=1e-9), name
    assert want["forward"]["penalty"][3] > 0 and want["forward"]["penalty"][2] == 0  # a scalar, apart
    assert got["forward"]["pos"][2] == 2 * want["forward"]["pos"][2]  # counted once per rank: alike on each
    assert got["forward"]["inp"][2] == want["forward"]["inp"][2]  # each rank's own rows
    for name, stats in want["backward"].items():
        assert got["backward"][name] == pytest.approx(stats, rel=1e-9, abs=1e-12), name
    for name, (total, projection, _) in want["grads"].items():
        t, p, _ = got["grads"][name]  # the linear statistics: the squares do not add up across ranks
        assert (t, p) == (pytest.approx(total, rel=1e-9, abs=1e-12), pytest.approx(projection, rel=1e-9, abs=1e-12))


def test_the_line_names_the_modules_in_the_order_they_ran() -> None:
    net = Net()
    probes = Probes(net, list(net.named_parameters()), last=1, share=1.0)
    try:
        net(_batch()).sum().backward()
        line = probes.line(probes.take(torch.device("cpu")).tolist())  # type: ignore[union-attr]
    finally:
        probes.close()
    forward = list(line["forward"])
    assert forward.index("inp") < forward.index("drop") < forward.index("mha") < forward.index("head")
    assert forward[-1] == "(model)" and next(iter(line["backward"])) == "head"
    assert set(line["grads"]) == {n for n, _ in net.named_parameters()} and probes.take(torch.device("cpu")) is None


# ---------------------------------------------------------------------------------------------- the fingerprint
def _train(tmp_path: Path, steps: int, **env: str) -> tuple[list[dict[str, Any]], Any]:
    path = tmp_path / "fp.jsonl"
    environ = {"UNIDIST_DEVICE": "cpu", "UNIDIST_FINGERPRINT": str(path), **env}
    stopped = None
    with unidist.init(environ=environ) as mgr:
        net = Net()
        model, opt = mgr.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        try:
            for s in range(steps):
                mgr.backward(model(_batch()).pow(2).mean())
                opt.step()
                opt.zero_grad()
                if s == 0:
                    mgr.save_checkpoint(tmp_path / "ck", model, opt)
                    mgr.load_checkpoint(tmp_path / "ck", model, opt)
        except SystemExit as stop:
            stopped = stop.code
    return [json.loads(line) for line in path.read_text().splitlines()], stopped


def test_the_fingerprint_has_the_start_the_digest_the_events_and_the_random_ops(tmp_path: Path) -> None:
    lines, stopped = _train(tmp_path, 2, UNIDIST_FINGERPRINT_RANDOM="off")
    head, start, first, save, load, second = lines
    assert stopped is None and head["unidist_fingerprint"] == 2 and head["random"] == "off"
    torch.manual_seed(0)
    net = Net()
    assert start["step"] == 0 and start["params"]["head.bias"][1] == pytest.approx(float(net.head.bias.detach().sum()))
    x = _batch().double()
    assert first["digest"] == pytest.approx(float(torch.sin(x * 1.6180339887498949 + 0.5).sum()), rel=1e-12)
    assert first["random"]["drop:dropout"] == 1 and first["step"] == 1
    assert (save["event"], load["event"], save["after_step"]) == ("save", "load", 1)
    assert save["path"] == str(tmp_path / "ck") and second["step"] == 2


def test_a_locate_run_probes_its_steps_and_stops_after_the_last(tmp_path: Path) -> None:
    lines, stopped = _train(tmp_path, 5, UNIDIST_FINGERPRINT_LOCATE="2", UNIDIST_FINGERPRINT_PERTURB="1")
    steps = [line for line in lines[1:] if line.get("step")]
    assert stopped == 0 and [s["step"] for s in steps] == [1, 2]
    assert lines[0]["locate"] == 2 and lines[0]["perturb"] == 1 and "random" not in lines[0]
    assert all(set(s["probes"]) == {"forward", "backward", "grads"} for s in steps)


def test_default_launches_are_one_process_then_each_usable_backends_main_launch() -> None:
    """No --launch: python first, then every usable backend with a launcher at 2 ranks, in the given order, each
    with its record's variables (DeepSpeed's CPU accelerator on a CPU machine) and UNIDIST_BACKEND naming it; a
    backend without a launcher (local) is left out. (The launches themselves run in tests/multiproc/test_verify.py
    and in the docs' verify command.)"""
    import sys

    from unidist.verify.launches import default_launches

    made = default_launches("train.py", ["--epochs", "1"], ["local", "mpi", "torch", "deepspeed", "horovod"],
                            lambda backend, n, script, args: [f"launch-{backend}", str(n), script, *args], gpu=False)
    assert [m.label for m in made] == ["python", "mpi-2", "torch-2", "deepspeed-2", "horovod-2"]
    assert made[0].argv == [sys.executable, "train.py", "--epochs", "1"]
    assert made[1].argv == ["launch-mpi", "2", "train.py", "--epochs", "1"]
    assert all(m.env["UNIDIST_BACKEND"] == m.label[:-2] for m in made[1:])
    assert made[3].env.get("DS_ACCELERATOR") == "cpu"
