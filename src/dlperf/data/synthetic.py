"""The embedded default dataset: procedural 28x28 glyphs in 10 classes, generated deterministically.

Why generated rather than shipped: the installed packages (torch, numpy, matplotlib, ...) carry no
image-classification dataset, and the project must train without a network. Drawing the images costs
about a second and no disk space, and the same seed gives the same dataset on every run.

Each class is a glyph built from strokes (ring, disk, square outline, filled square, two bars, plus,
cross, T, L, double ring). Every image draws its glyph with a random shift (+-3 px), scale (0.8-1.15),
rotation (+-20 degrees), stroke width and brightness, adds a faint stray stroke half of the time and
pixel noise, and is stored as uint8 like Fashion-MNIST. Some pairs are easy to confuse under these
distortions (ring / double ring, disk / filled square, plus / cross / T), so a linear model stays well
below a small CNN: the set is learnable but not trivial.

>>> (Xtr, ytr), (Xte, yte) = glyphs(train=100, test=20, seed=0)
>>> Xtr.shape, Xtr.dtype, int(ytr.max()) <= 9
(torch.Size([100, 28, 28]), torch.uint8, True)
"""

from __future__ import annotations

import math

import torch

__all__ = ["glyphs", "CLASSES"]

CLASSES = ("ring", "disk", "square", "block", "bars", "plus", "cross", "tee", "ell", "rings")

_Seg = tuple[float, float, float, float]
# Strokes per class as segments (x0, y0, x1, y1) in pixels around the centre, y pointing down.
_SEGMENTS: dict[int, list[_Seg]] = {
    2: [(-7, -7, 7, -7), (7, -7, 7, 7), (7, 7, -7, 7), (-7, 7, -7, -7)],
    4: [(-8, -5, 8, -5), (-8, 5, 8, 5)],
    5: [(-8, 0, 8, 0), (0, -8, 0, 8)],
    6: [(-7, -7, 7, 7), (-7, 7, 7, -7)],
    7: [(-8, -7, 8, -7), (0, -7, 0, 8)],
    8: [(-6, -8, -6, 8), (-6, 8, 7, 8)],
}
_RINGS: dict[int, list[float]] = {0: [8.0], 9: [4.0, 9.0]}


def _segment_distance(x: torch.Tensor, y: torch.Tensor, s) -> torch.Tensor:
    """Distance to the segment ``s`` (numbers, or per-image tensors broadcastable against ``x``)."""
    x0, y0, x1, y1 = s
    dx, dy = x1 - x0, y1 - y0
    t = (((x - x0) * dx + (y - y0) * dy) / (dx * dx + dy * dy + 1e-6)).clamp(0, 1)
    return torch.hypot(x - (x0 + t * dx), y - (y0 + t * dy))


def _distance(c: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distance from each pixel to class ``c``'s strokes (0 inside filled shapes)."""
    if c in _RINGS:
        r = torch.hypot(x, y)
        return torch.stack([(r - rad).abs() for rad in _RINGS[c]]).amin(0)
    if c == 1:
        return (torch.hypot(x, y) - 7).clamp(min=0)
    if c == 3:
        return (torch.maximum(x.abs(), y.abs()) - 6).clamp(min=0)
    return torch.stack([_segment_distance(x, y, s) for s in _SEGMENTS[c]]).amin(0)


def _render(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    n = labels.shape[0]

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand((n, *shape), generator=g)

    shift = uniform(-3, 3, 2)
    scale = uniform(0.8, 1.15)
    angle = uniform(-math.pi / 9, math.pi / 9)
    width = uniform(0.9, 1.8)
    bright = uniform(0.55, 1.0)
    coords = torch.arange(28, dtype=torch.float32) - 13.5
    v, u = torch.meshgrid(coords, coords, indexing="ij")
    u = u.expand(n, 28, 28) - shift[:, 0, None, None]
    v = v.expand(n, 28, 28) - shift[:, 1, None, None]
    cos, sin = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
    s = scale[:, None, None]
    x, y = (cos * u + sin * v) / s, (-sin * u + cos * v) / s
    dist = torch.empty(n, 28, 28)
    for c in range(10):
        idx = (labels == c).nonzero().squeeze(1)
        if idx.numel():
            dist[idx] = _distance(c, x[idx], y[idx])
    img = bright[:, None, None] * torch.exp(-(dist / width[:, None, None]) ** 2)
    # a faint stray stroke in half the images, anywhere
    ends = uniform(-12, 12, 4)[:, :, None, None]
    stray = _segment_distance(u + shift[:, 0, None, None], v + shift[:, 1, None, None], ends.unbind(1))
    keep = (torch.rand(n, generator=g) < 0.5).float()[:, None, None]
    img = torch.maximum(img, keep * 0.45 * torch.exp(-(stray / 1.0) ** 2))
    img = img + 0.12 * torch.randn((n, 28, 28), generator=g)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def glyphs(train: int = 12000, test: int = 2000, seed: int = 0):
    """``((train_images, train_labels), (test_images, test_labels))``: uint8 (N, 28, 28) and int64 (N,).

    Classes are balanced (labels cycle 0..9, then are shuffled); the test set uses its own stream.
    """
    out = []
    for part, n in enumerate((train, test)):
        g = torch.Generator().manual_seed(seed * 2 + part + 0x5EED)
        labels = torch.arange(n) % 10
        labels = labels[torch.randperm(n, generator=g)]
        # chunks of 1024 keep the temporaries in cache; the stream of random numbers stays the same
        images = torch.cat([_render(part_labels, g) for part_labels in torch.split(labels, 1024)]) if n \
            else torch.empty(0, 28, 28, dtype=torch.uint8)
        out.append((images, labels))
    return out[0], out[1]
