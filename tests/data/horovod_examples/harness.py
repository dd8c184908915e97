"""What this machine cannot give Horovod's example scripts, and what the test needs back from them.

The scripts beside this file are Horovod's own PyTorch examples (see README.md). Upstream they download MNIST or
read ImageNet through torchvision, build torchvision's ResNet-50 and log to TensorBoard; none of that exists here
(no network, torchvision and tensorboard are not installed). This module stands in for exactly those pieces, the
same way in the real-Horovod copy and the compat copy of a script, and records what a run produced (each rank's
final weights, the lines it printed, the scalars it logged) so the test can compare two runs. It never calls
Horovod or unidist: the scripts' own hvd calls are the thing under test.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812 - spelled as the examples spell it

_PRINTED: list[str] = []
_SCALARS: list[tuple[str, float, int]] = []


class _Tee(io.TextIOBase):
    """Stdout that also keeps every printed line, so the test sees what each rank printed (launchers prefix or
    interleave the ranks' stdout; this is the rank's own copy)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._line = ""

    def write(self, text: str) -> int:
        self._stream.write(text)
        self._line += text
        *done, self._line = self._line.split("\n")
        _PRINTED.extend(done)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def record_stdout() -> None:
    """Keep a copy of everything print() writes from now on (called once, when --out is given)."""
    sys.stdout = _Tee(sys.stdout)  # type: ignore[assignment]


class ScalarRecorder:
    """Stands in for torch.utils.tensorboard.SummaryWriter (tensorboard is not installed): keeps add_scalar's
    values, which are the metrics the ImageNet example reports."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def add_scalar(self, tag: str, value: Any, step: int) -> None:
        _SCALARS.append((tag, float(value), int(step)))


def save_run(out: str | None, rank: int, model: nn.Module, **extra: Any) -> None:
    """Write rank ``rank``'s final weights, printed lines and logged scalars to ``out``/rank<r>.pt."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "printed": list(_PRINTED), "scalars": list(_SCALARS), **extra},
               os.path.join(out, f"rank{rank}.pt"))


def digits_as_mnist(train: bool, mean: float = 0.1307, std: float = 0.3081) -> torch.utils.data.TensorDataset:
    """MNIST's shape from scikit-learn's bundled digits (1797 8x8 images, no download): scaled to [0, 1],
    upscaled to 1x28x28 and normalized with MNIST's constants, as the example's transforms would. The first 1500
    images train, the remaining 297 test. The file is read as sklearn.datasets.load_digits reads it (64 pixel
    columns, then the label), without importing sklearn.datasets: that import costs ~1.7 s of CPU per process."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-learn is not installed: pip install scikit-learn (it ships the digits data)")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
    table = np.loadtxt(path, delimiter=",")
    x = torch.tensor(table[:, :-1], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - mean) / std
    y = torch.tensor(table[:, -1], dtype=torch.long)
    part = slice(0, 1500) if train else slice(1500, None)
    return torch.utils.data.TensorDataset(x[part], y[part])


def synthetic_images(count: int, classes: int, seed: int, size: int = 32) -> torch.utils.data.TensorDataset:
    """Stands in for an ImageFolder of ImageNet: ``count`` normalized 3 x size x size images whose label is
    decided by the image (so training makes progress), drawn from their own generator (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 3, size, size, generator=gen)
    centers = torch.randn(classes, 3, size, size, generator=gen)
    y = torch.randint(0, classes, (count,), generator=gen)
    return torch.utils.data.TensorDataset(x * 0.5 + centers[y], y)


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm and an identity (or 1x1) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def tiny_resnet(num_classes: int = 1000) -> nn.Module:
    """Stands in for torchvision.models.resnet50 (torchvision is not installed; ResNet-50 takes minutes per step on
    two shared CPU cores): the same kinds of layers (conv, batch norm with running statistics, residual blocks,
    global pooling, a linear head), about 30k parameters plus the head."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        _Block(16, 16, 1), _Block(16, 32, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


class models:  # noqa: N801 - spelled as the torchvision module it stands in for
    """``getattr(models, args.model)()`` as the examples call torchvision.models."""

    tiny_resnet: Callable[..., nn.Module] = staticmethod(tiny_resnet)
