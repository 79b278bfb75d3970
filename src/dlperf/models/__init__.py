"""The benchmark model zoo: Shi et al. (2016)'s seven networks and d2l chapter 12's models.

>>> from dlperf.models import get_spec
>>> spec = get_spec("alexnet-r")
>>> x, y = spec.input.make_batch(4)
>>> spec.build()(x).shape
torch.Size([4, 10])
"""

from __future__ import annotations

from .alexnet import alexnet_r, alexnet_s
from .fcn import fcn_r, fcn_s, mlp
from .lenet import lenet
from .lstm import LSTMLanguageModel
from .resnet import resnet18, resnet50, resnet56
from .spec import InputSpec, ModelSpec, get_model, get_spec, model_names, num_params, register

__all__ = ["InputSpec", "ModelSpec", "get_model", "get_spec", "model_names", "num_params", "register"]

_IMAGENET = InputSpec((3, 224, 224), 1000)
_CIFAR = InputSpec((3, 32, 32), 10)
_MNIST = InputSpec((1, 28, 28), 10)

# Order follows Table 7; batch sizes are Table 9 (CPU) and the note under Table 7 (GPU).
register(ModelSpec("fcn-s", fcn_s, InputSpec((26752,), 26752), 64, 64,
                   "FC 26752-2048-2048-2048-26752, sigmoid"))
register(ModelSpec("alexnet-s", alexnet_s, _IMAGENET, 16, 16, "AlexNet, 224x224, no LRN/dropout"))
register(ModelSpec("resnet-50", resnet50, _IMAGENET, 16, 16, "ResNet-50, bottleneck [3,4,6,3]"))
register(ModelSpec("fcn-r", fcn_r, InputSpec((784,), 10), 1024, 1024, "FC 784-2048-4096-1024-10, sigmoid"))
register(ModelSpec("alexnet-r", alexnet_r, _CIFAR, 128, 1024, "cuda-convnet CIFAR-10 network"))
register(ModelSpec("resnet-56", resnet56, _CIFAR, 128, 128, "CIFAR ResNet-56, option-A shortcuts"))
register(ModelSpec("lstm", LSTMLanguageModel, InputSpec((32,), 10000, kind="tokens"), 256, 128,
                   "PTB LM: embed 256, 2x LSTM 256, 32 steps"))
register(ModelSpec("lenet", lenet, _MNIST, 256, 256, "d2l 12.5 LeNet", paper=False))
register(ModelSpec("resnet18", resnet18, _MNIST, 256, 256, "d2l 12.6 ResNet-18, 28x28", paper=False))
register(ModelSpec("mlp", mlp, InputSpec((512,), 2), 1, 1, "d2l 12.1 MLP 512-256-128-2", paper=False))
