"""The model zoo (the Flax MNIST CNN, an MLP, ResNets, a Wide ResNet, a small ViT) and its
convolutions; :func:`build_model` fits a zoo model to the data's input shape and classes.

Example:
  >>> model = me.models.get_model("cnn")     # or me.models.CNN()
  >>> me.models.build_model("wrn", (32, 32, 3), 10, depth=10, width=1).depth
  10
"""

from meshensemble.models import conv as conv
from meshensemble.models.vit import LOGICAL_AXIS_RULES as LOGICAL_AXIS_RULES
from meshensemble.models.vit import ViT as ViT
from meshensemble.models.vit import param_logical_axes as param_logical_axes
from meshensemble.models.zoo import CNN as CNN
from meshensemble.models.zoo import MLP as MLP
from meshensemble.models.zoo import REGISTRY as REGISTRY
from meshensemble.models.zoo import HowtoCNN as HowtoCNN
from meshensemble.models.zoo import ResidualBlock as ResidualBlock
from meshensemble.models.zoo import ResNet as ResNet
from meshensemble.models.zoo import ResNet20 as ResNet20
from meshensemble.models.zoo import WideResNet as WideResNet
from meshensemble.models.zoo import batch_axis as batch_axis
from meshensemble.models.zoo import build_model as build_model
from meshensemble.models.zoo import get_model as get_model

__all__ = [
    "CNN",
    "MLP",
    "REGISTRY",
    "HowtoCNN",
    "LOGICAL_AXIS_RULES",
    "ResNet",
    "ResNet20",
    "WideResNet",
    "ResidualBlock",
    "ViT",
    "batch_axis",
    "build_model",
    "conv",
    "get_model",
    "param_logical_axes",
]
