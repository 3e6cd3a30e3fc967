"""The model zoo (the Flax MNIST CNN, an MLP, a small ResNet, a small ViT) and its convolutions.

Example:
  >>> model = me.models.get_model("cnn")     # or me.models.CNN()
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
from meshensemble.models.zoo import batch_axis as batch_axis
from meshensemble.models.zoo import get_model as get_model

__all__ = [
    "CNN",
    "MLP",
    "REGISTRY",
    "HowtoCNN",
    "LOGICAL_AXIS_RULES",
    "ResNet",
    "ResidualBlock",
    "ViT",
    "batch_axis",
    "conv",
    "get_model",
    "param_logical_axes",
]
