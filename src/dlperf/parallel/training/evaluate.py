"""Multi-device evaluation: split each batch across the replicas, run them at once, combine the counts.

Inputs and labels may be tensors or structures of them (:mod:`dlperf.batch`): a tuple of inputs is the
model's positional arguments, a dict its one argument.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ...batch import Batch, batch_size, call_model, describe, map_tensors
from ...devices import Device
from ...engine import Engine, wait_ops
from ...errors import UsageError
from ...losses import labels_of
from ...losses import predictions as output_scores
from ..split import split_batch

__all__ = ["evaluate_accuracy"]


def _correct(model: nn.Module, X: Batch, y: Batch, predict: Callable[[Any], Any] | None = None) -> int:
    with torch.no_grad():
        out = call_model(model, X)
    scores = predict(out) if predict is not None else output_scores(out)
    labels = labels_of(X, y)
    if not isinstance(scores, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise UsageError(f"accuracy compares a tensor of scores (the output, or its 'logits') with a tensor of labels "
                         f"(the targets, or the batch's 'labels'); the model returned {describe(out)} for labels "
                         f"{describe(labels)}: give predictions=fn(outputs) returning the scores")
    return int((scores.argmax(dim=-1) == labels).sum())


def evaluate_accuracy(replicas: Sequence[nn.Module], data: Iterable[tuple[Any, Any]],
                      devices: Sequence[Device], engine: Engine | None = None,
                      prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      predictions: Callable[[Any], Any] | None = None) -> float:
    """Fraction of examples whose arg-max prediction equals the label.

    Batches smaller than the device count are evaluated on the first devices only. ``prepare`` is
    applied to every input tensor of a part (a memory layout, say). The scores are the model's output, or its
    ``logits`` where it returns a mapping or object (``predictions(outputs)`` when given); the labels are the
    batch's targets, or the ``labels`` a mapping batch carries.

    >>> from dlperf.devices import cpu
    >>> net = nn.Linear(2, 2)
    >>> with torch.no_grad():  # identity: the prediction for row i is class i
    ...     _ = net.weight.copy_(torch.eye(2)), net.bias.zero_()
    >>> X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])
    >>> evaluate_accuracy([net], [(X, torch.tensor([0, 1, 1, 1]))], [cpu(0)])
    0.75
    """
    modes = [r.training for r in replicas]
    for r in replicas:
        r.eval()
    right = seen = 0
    try:
        for batch in data:
            X, y = (batch, None) if isinstance(batch, Mapping) else batch
            n = batch_size(X, "input")
            k = min(len(devices), n)
            Xs, ys = split_batch(X, y, devices[:k], even_split=False)
            if prepare is not None:
                Xs = [map_tensors(prepare, x) for x in Xs]
            jobs = [partial(_correct, replicas[i], Xs[i], ys[i], predictions) for i in range(k)]
            if engine is None:
                counts = [job() for job in jobs]
            else:
                ops = [engine.push(job, device=devices[i], name=f"evaluate {devices[i]}") for i, job in enumerate(jobs)]
                counts = wait_ops(ops)
            right += sum(counts)
            seen += n
    finally:
        for r, m in zip(replicas, modes):
            r.train(m)
    return right / seen if seen else 0.0
