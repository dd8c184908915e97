"""A seeded in-memory CIFAR10 with torchvision's spelling, for DeepSpeedExamples' cifar10_deepspeed.py.

This machine has no network and no torchvision, so the script's ``torchvision.datasets.CIFAR10(root=...,
download=True, transform=...)`` and ``transforms.Compose([transforms.ToTensor(), transforms.Normalize(...)])``
cannot run. The script imports this module under torchvision's names instead (its only data change), and every
line that builds or uses the data stays upstream's. The images are what ``ToTensor`` would give for CIFAR10 (3 x
32 x 32 floats in [0, 1]) with a label each of the 10 classes decides (a smooth per-class pattern plus pixel
noise), so training makes progress and the gradients have CIFAR's magnitudes (the script's gradient_clipping 1.0
then acts on some steps). The data depend only on ``train`` (its own seed per split), never on the rank or the
launcher, so every run of every case sees the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's usual spelling

TRAIN_SIZE = 384  # 24 steps of the script's train_batch_size 16: a few dozen steps, one epoch
TEST_SIZE = 40  # 4 of each class: the script's test() needs a multiple of its batch 4 and every class present
CLASSES = 10
PATTERN_SEED = 10  # the classes' looks: shared by both splits, so test accuracy means something


def _images(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images in [0, 1] and balanced labels (each class ``count // 10`` times, shuffled)."""
    layouts = torch.rand(CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(PATTERN_SEED))
    patterns = F.interpolate(layouts, size=(32, 32), mode="bilinear", align_corners=False)  # one per class
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % CLASSES
    labels = labels[torch.randperm(count, generator=gen)]
    noise = torch.rand(count, 3, 32, 32, generator=gen)
    return (0.6 * patterns[labels] + 0.4 * noise).clamp(0.0, 1.0), labels


class _Transforms:
    """``torchvision.transforms``' names the scripts use, on tensors (there are no PIL images here)."""

    class ToTensor:
        """The stand-in's images already are ToTensor's output (float, channels first, in [0, 1])."""

        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return image

    class Normalize:
        """(image - mean) / std per channel, as torchvision's Normalize."""

        def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return (image - self.mean) / self.std

    class Resize:
        """The shorter side to ``size`` (bilinear), as torchvision's Resize on a square image."""

        def __init__(self, size: int) -> None:
            self.size = size

        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return F.interpolate(image[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]

    class CenterCrop:
        """The central ``size`` x ``size`` pixels."""

        def __init__(self, size: int) -> None:
            self.size = size

        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            top, left = (image.shape[-2] - self.size) // 2, (image.shape[-1] - self.size) // 2
            return image[..., top:top + self.size, left:left + self.size]

    class Compose:
        """Each transform in turn."""

        def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
            self.steps = list(steps)

        def __call__(self, image: Any) -> Any:
            for step in self.steps:
                image = step(image)
            return image


transforms = _Transforms()


class CIFAR10(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """torchvision's CIFAR10 signature; ``root`` and ``download`` are accepted and ignored (nothing is read or
    fetched). The transform is applied once per image here rather than per access: it is deterministic, and the
    samples are then plain tensors (the DeepSpeed data loader's two worker processes fork cheaply)."""

    def __init__(self, root: str, train: bool = True, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, download: bool = False) -> None:
        images, labels = _images(TRAIN_SIZE if train else TEST_SIZE, seed=2024 if train else 2025)
        if transform is not None:
            images = torch.stack([transform(image) for image in images])
        self.data = images
        self.targets = [int(y) for y in labels]
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        target = self.targets[index]
        return self.data[index], self.target_transform(target) if self.target_transform else target


class datasets:  # noqa: N801 - spelled as the torchvision module it stands in for
    """``torchvision.datasets.CIFAR10`` as the script calls it."""

    CIFAR10 = CIFAR10
