"""prepare's contract on one process: validation before anything changes, a real torch Optimizer, clipping."""

from __future__ import annotations

import copy

import pytest
import torch

import unidist
from unidist import Config, InvalidArgumentError, LaunchInfo
from unidist.request import PrepareRequest

# the models and batches here are CPU tensors: the Manager is told the CPU, so that a GPU machine runs the same tests
ON_CPU = {"UNIDIST_DEVICE": "cpu"}


@pytest.fixture
def mgr() -> unidist.Manager:
    with unidist.LocalManager(Config.from_env(ON_CPU), LaunchInfo()) as m:
        yield m


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


BAD = [
    ({"config": {}}, "did you mean deepspeed_config=?"),
    ({"clip_grad": 1.0}, "did you mean clip_grad_norm=?"),  # the names docs/training.md promises a hint for
    ({"zero_stag": 2}, "did you mean zero_stage=?"),
    ({"precison": "32"}, "did you mean precision=?"),
    ({"gradient_clipping": 1.0}, "did you mean clip_grad_norm=?"),
    ({"gradient_accumulation_steps": 2}, "did you mean backward_passes_per_step=?"),
    ({"precision": "fp16"}, "precision='fp16'); use one of '32', 'bf16-mixed', 'fp16-mixed', 'bf16-true'"),
    ({"precision": "16-mixed"}, "precision='16-mixed'"),
    ({"loss_scaling": {"init_scale": 8.0}}, "pass it with precision='fp16-mixed'"),
    ({"precision": "fp16-mixed", "loss_scaling": {"init_scal": 8.0}}, "unknown key(s) ['init_scal']"),
    ({"precision": "fp16-mixed", "loss_scaling": {"backoff_factor": 2.0}}, "0 < backoff_factor < 1"),
    ({"precision": "fp16-mixed", "loss_scaling": 3}, "takes a dict of GradScaler's parameters"),
    ({"clip_grad_norm": 0.0}, "clip_grad_norm=0.0"),
    ({"clip_grad_norm": float("inf")}, "clip_grad_norm=inf"),
    ({"clip_grad_norm": True}, "clip_grad_norm=True"),
    ({"op": "max"}, "op='max'"),
    ({"op": "median"}, "unknown reduction op 'median'"),
    ({"compression": "int8"}, "compression='int8'"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step=0"),
    ({"backward_passes_per_step": 1.5}, "backward_passes_per_step=1.5"),
    ({"bucket_mb": -1}, "bucket_mb=-1"),
    ({"zero_stage": 4}, "zero_stage=4"),
    ({"deepspeed_config": {}}, "deepspeed backend only, and this run uses local"),
    ({"deepspeed_config": 3}, "takes a dict or a JSON file path"),
    ({"reducer": "fastest"}, "reducer='fastest'); use one of auto, engine, unidist"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[str(k) for k, _ in BAD])
def test_bad_arguments_are_refused_before_anything_changes(mgr: unidist.Manager, kwargs: dict[str, object],
                                                           message: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks_before = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match="prepare") as err:
        mgr.prepare(model, opt, **kwargs)
    assert message in str(err.value)
    assert [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()] == hooks_before


def test_unknown_keyword_lists_the_accepted_ones(mgr: unidist.Manager) -> None:
    model = _model()
    with pytest.raises(InvalidArgumentError) as err:
        mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), warmup=3)
    assert all(name in str(err.value) for name in PrepareRequest.names())


def test_model_and_optimizer_kinds(mgr: unidist.Manager) -> None:
    model = _model()
    with pytest.raises(InvalidArgumentError, match=r"torch\.nn\.Module"):
        mgr.prepare("model", torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"torch\.optim\.Optimizer"):
        mgr.prepare(model, None)


def test_prepared_optimizer_is_a_torch_optimizer_sharing_groups_and_state(mgr: unidist.Manager) -> None:
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = mgr.prepare(model, inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.005)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    assert opt.param_groups is inner.param_groups  # still the live lists after the inner optimizer replaced them
    assert opt.state_dict()["state"][0]["step"] == saved["state"][0]["step"]
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra], "lr": 0.1})
    assert len(inner.param_groups) == 2
    # one rank reduces nothing: no bucket, no gradient hook (the added group's parameters included)
    assert opt.buckets == [] and opt.bucket_of(extra) is None and mgr.size == 1


def test_clip_grad_norm_matches_torch(mgr: unidist.Manager) -> None:
    ref, model = _model(), _model()
    x, y = torch.randn(16, 4), 50 * torch.randn(16, 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=0.5)
    mgr.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    assert norm > 10  # the clip is active
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_prepare_twice_on_one_model_is_refused() -> None:
    with unidist.init(environ=ON_CPU) as mgr:
        model = torch.nn.Linear(3, 2)
        prepared, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for again in (model, prepared):
            with pytest.raises(unidist.InvalidArgumentError, match="already called for this model"):
                mgr.prepare(again, torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=1)
        assert opt._hooks == []  # nothing was added (one rank: no gradient hook at all)


def test_the_keywords_are_the_requests_fields_and_all_reach_it() -> None:
    """Manager.prepare's keywords are PrepareRequest's fields, each handed to the request by name (a keyword left out
    of the hand-over would be dropped without a word)."""
    import ast
    import inspect
    import textwrap

    from unidist.managers.training import TrainingEntryPoints

    signature = inspect.signature(TrainingEntryPoints.prepare)
    keywords = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(keywords) == sorted(PrepareRequest.names())
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainingEntryPoints.prepare)))
    handed = [k.arg for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict"
              for k in node.keywords if k.arg]
    assert sorted(handed) == sorted(keywords)


def test_prepare_returns_the_prepared_optimizer_contract(mgr: unidist.Manager) -> None:
    from unidist.prepared import PreparedOptimizer

    for stage in (0, 1, 3):
        model = _model()
        prepared, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1), zero_stage=stage,
                                    clip_grad_norm=0.5, backward_passes_per_step=2)
        assert isinstance(opt, PreparedOptimizer) and isinstance(opt, torch.optim.Optimizer)
        assert (opt.zero_stage, opt.clipping, opt.backward_passes_per_step) == (stage, 0.5, 2)
        assert (opt.loss_scale, opt.last_step_skipped, opt.skipped_steps, opt.last_grad_norm) == (1.0, False, 0, None)
        x = torch.randn(8, 4)
        for _ in range(2):
            mgr.backward(prepared(x).pow(2).sum() * 100)
            opt.step()
            opt.zero_grad()
        assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.5  # measured before the clip
