"""Hybrid programming (d2l 12.1): capture an imperative model as a graph, replay it, export it.

>>> import torch
>>> from dlperf.hybrid import hybridize
>>> from dlperf.models import get_model
>>> net = hybridize(get_model("mlp"))
>>> with torch.no_grad():
...     y = net(torch.randn(1, 512))
"""

from __future__ import annotations

from .backends import backend_names, get_backend, register_backend
from .capture import CaptureError
from .export import FORMAT_VERSION, ExportedModule, ExportFormatError, export, load, load_pt2
from .hybridize import HybridizeWarning, HybridModule, hybridize
from .train_step import TrainStep, make_train_step, train_step

__all__ = ["FORMAT_VERSION", "CaptureError", "ExportFormatError", "ExportedModule", "HybridModule",
           "HybridizeWarning", "TrainStep", "backend_names", "export", "get_backend", "hybridize", "load", "load_pt2",
           "make_train_step", "register_backend", "train_step"]
