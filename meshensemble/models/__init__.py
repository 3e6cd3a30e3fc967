"""The model zoo (the Flax MNIST CNN, an MLP, ResNets, a Wide ResNet, a small ViT) and its
convolutions; :func:`build_model` fits a zoo model to the data's input shape and classes;
BatchEnsemble versions of the CNN and MLP, and LoRA adapters for any of them.

Example:
  >>> model = me.models.get_model("cnn")     # or me.models.CNN()
  >>> me.models.build_model("wrn", (32, 32, 3), 10, depth=10, width=1).depth
  10
"""

from meshensemble.models import conv as conv
from meshensemble.models.batchensemble import BatchEnsembleCNN as BatchEnsembleCNN
from meshensemble.models.batchensemble import BatchEnsembleMLP as BatchEnsembleMLP
from meshensemble.models.batchensemble import BEConv as BEConv
from meshensemble.models.batchensemble import BEDense as BEDense
from meshensemble.models.batchensemble import batchensemble_shared as batchensemble_shared
from meshensemble.models.lora import LoRA as LoRA
from meshensemble.models.lora import lora as lora
from meshensemble.models.lora import lora_backbone as lora_backbone
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

REGISTRY.update(be_cnn=BatchEnsembleCNN, be_mlp=BatchEnsembleMLP)  # train with their filter

__all__ = [
    "BEConv",
    "BEDense",
    "BatchEnsembleCNN",
    "BatchEnsembleMLP",
    "CNN",
    "MLP",
    "REGISTRY",
    "HowtoCNN",
    "LOGICAL_AXIS_RULES",
    "ResNet",
    "ResNet20",
    "WideResNet",
    "ResidualBlock",
    "LoRA",
    "ViT",
    "batch_axis",
    "batchensemble_shared",
    "build_model",
    "conv",
    "get_model",
    "lora",
    "lora_backbone",
    "param_logical_axes",
]
