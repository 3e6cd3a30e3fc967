"""The model zoo (the Flax MNIST CNN, an MLP, a small ResNet) and its convolutions.

Example:
  >>> model = me.models.get_model("cnn")     # or me.models.CNN()
"""

from meshensemble.models import conv as conv
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
    "ResNet",
    "ResidualBlock",
    "batch_axis",
    "conv",
    "get_model",
]
