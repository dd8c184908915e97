"""The benchmark models, generated from their layer plans: nothing is downloaded, torchvision is not needed.

``gradsync`` needs only the parameter shapes of real models (the sizes and the number of tensors are what
gradient synchronisation costs depend on): ``resnet50_shapes`` (161 tensors, 25,557,032 parameters, as
torchvision's resnet50) and ``gpt2_shapes`` (148 tensors, 124,439,808 parameters, as GPT-2 small), held by
a ``ShapeModel`` whose forward is nearly free so that backward is cheap and the sync dominates.

``train`` needs a real network: ``resnet`` builds torchvision's ResNet layout (basic blocks; resnet18 by
default) in a few lines, for synthetic 3x64x64 images.

``scale`` multiplies every width (and GPT-2's vocabulary and context): the tensor count stays, the bytes
shrink, so a smoke run exercises the same code paths in a fraction of a second.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "ShapeModel", "gpt2_shapes", "resnet", "resnet50_shapes"]

Shapes = list[tuple[str, tuple[int, ...]]]


def _w(channels: int, scale: float) -> int:
    return max(1, round(channels * scale))


def resnet50_shapes(scale: float = 1.0) -> Shapes:
    """torchvision resnet50's parameters in registration order: conv1, bn1, four stages of [3, 4, 6, 3]
    bottleneck blocks (1x1, 3x3, 1x1 convolutions without bias, each followed by a batch norm's weight and
    bias; expansion 4; the first block of each stage has a 1x1 downsample convolution and batch norm), fc."""
    shapes: Shapes = []

    def conv_bn(prefix: str, bn: str, out: int, inp: int, k: int) -> None:
        shapes.append((f"{prefix}.weight", (out, inp, k, k)))
        shapes.extend([(f"{bn}.weight", (out,)), (f"{bn}.bias", (out,))])

    width = _w(64, scale)
    conv_bn("conv1", "bn1", width, 3, 7)
    inplanes = width
    for stage, (blocks, planes) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True), start=1):
        p = _w(planes, scale)
        out = 4 * p
        for b in range(blocks):
            pre = f"layer{stage}.{b}"
            conv_bn(f"{pre}.conv1", f"{pre}.bn1", p, inplanes, 1)
            conv_bn(f"{pre}.conv2", f"{pre}.bn2", p, p, 3)
            conv_bn(f"{pre}.conv3", f"{pre}.bn3", out, p, 1)
            if b == 0:
                conv_bn(f"{pre}.downsample.0", f"{pre}.downsample.1", out, inplanes, 1)
            inplanes = out
    classes = _w(1000, scale)
    shapes.extend([("fc.weight", (classes, inplanes)), ("fc.bias", (classes,))])
    return shapes


def gpt2_shapes(scale: float = 1.0) -> Shapes:
    """GPT-2 small's parameters in registration order (Hugging Face's layout, Conv1D weights stored
    in x out): token and position embeddings (50257 and 1024 x 768), 12 blocks of layer norm, attention
    (c_attn 768 x 2304, c_proj 768 x 768), layer norm and MLP (768 x 3072 and back), each with biases, and
    the final layer norm. The output layer is tied to wte, so it adds no tensor."""
    d, vocab, ctx = _w(768, scale), _w(50257, scale), _w(1024, scale)
    shapes: Shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(12):
        pre = f"h.{i}"
        shapes += [(f"{pre}.ln_1.weight", (d,)), (f"{pre}.ln_1.bias", (d,)),
                   (f"{pre}.attn.c_attn.weight", (d, 3 * d)), (f"{pre}.attn.c_attn.bias", (3 * d,)),
                   (f"{pre}.attn.c_proj.weight", (d, d)), (f"{pre}.attn.c_proj.bias", (d,)),
                   (f"{pre}.ln_2.weight", (d,)), (f"{pre}.ln_2.bias", (d,)),
                   (f"{pre}.mlp.c_fc.weight", (d, 4 * d)), (f"{pre}.mlp.c_fc.bias", (4 * d,)),
                   (f"{pre}.mlp.c_proj.weight", (4 * d, d)), (f"{pre}.mlp.c_proj.bias", (d,))]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


MODELS = {"resnet50": resnet50_shapes, "gpt2": gpt2_shapes}


class ShapeModel(nn.Module):
    """Parameters of the given shapes, registered in order (gradient buckets follow registration order).

    ``forward(c)`` is ``sum((p * c).sum())``: its backward writes ``c`` into every gradient, one cheap pass
    per tensor, so the time of ``backward`` alone is a small baseline to subtract from backward + sync.
    """

    def __init__(self, shapes: Shapes, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.names = [name for name, _ in shapes]
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(shape, generator=gen) * 0.01)
                                        for _, shape in shapes)

    def forward(self, c: float) -> torch.Tensor:
        return torch.stack([(p * c).sum() for p in self.weights]).sum()


class _Block(nn.Module):
    """torchvision's BasicBlock: two 3x3 convolutions with batch norm, identity or 1x1 downsample shortcut."""

    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.downsample(x))


def resnet(layers: tuple[int, ...] = (2, 2, 2, 2), scale: float = 1.0, classes: int = 1000) -> nn.Module:
    """torchvision's ResNet with basic blocks (resnet18: layers (2, 2, 2, 2), 11.7 M parameters at scale 1):
    7x7 stem, max pool, four stages of widths 64-512 (x scale), global average pool, fc."""
    torch.manual_seed(0)
    width = _w(64, scale)
    mods: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                             nn.MaxPool2d(3, 2, 1)]
    inp = width
    for stage, blocks in enumerate(layers):
        out = _w(64 * 2**stage, scale)
        for b in range(blocks):
            mods.append(_Block(inp, out, 2 if stage and b == 0 else 1))
            inp = out
    mods += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, classes)]
    return nn.Sequential(*mods)
