"""A user's Flax module as a member model: ``--model module:Class`` (or ``module:function``).

One resolver for every pluggable piece (:func:`meshensemble.runtime.plugins.load_object`,
the one ``--task module:Class`` uses) imports it; this module says what a model spec may
name and builds the module.

Example:
  >>> user_model("meshensemble.models:MLP")
  MLP(...)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from meshensemble.runtime.plugins import load_object

FIX = (
    "give a flax.linen.Module subclass whose fields all have defaults, a module instance, or "
    "a function taking no arguments that returns one"
)


def is_spec(name: Any) -> bool:
    """Whether ``name`` is a ``module:attr`` spec rather than a registry name.

    Example:
      >>> is_spec("mymodels:Net"), is_spec("cnn")
      (True, False)
    """
    return isinstance(name, str) and ":" in name


def user_model(spec: str) -> nn.Module:
    """The Linen module ``spec = "module:attr"`` names, built with its defaults.

    ``attr`` may be a ``flax.linen.Module`` subclass (built with no arguments: its field
    defaults), a module instance, or a function of no arguments returning a module.

    Args:
      spec: ``"package.module:Name"`` (the module importable: its folder on
        ``PYTHONPATH``).

    Returns:
      A fresh Linen module.

    Raises:
      ValueError: a bad spec, a module that does not import, no such attribute, or not a
        Linen module (one line naming ``spec`` and the fix).

    Example:
      >>> user_model("meshensemble.models:MLP").features   # the class's defaults
      (128,)
    """
    obj = load_object(spec, "model")
    what = f"model={spec!r}"
    if isinstance(obj, nn.Module):
        return obj.clone()
    if isinstance(obj, type) and not issubclass(obj, nn.Module):
        raise ValueError(f"{what} is the class {obj.__qualname__}, not a flax.linen.Module; {FIX}")
    if not callable(obj):
        raise ValueError(f"{what} is a {type(obj).__name__}, not a flax.linen.Module; {FIX}")
    try:
        built = obj()
    except Exception as err:  # a user's constructor may raise anything
        why = " ".join(str(err).split())[:160]
        raise ValueError(
            f"{what}: {getattr(obj, '__qualname__', obj)}() failed ({type(err).__name__}: "
            f"{why}); {FIX}"
        ) from None
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"{what}: {getattr(obj, '__qualname__', obj)}() returned a "
            f"{type(built).__name__}, not a flax.linen.Module; {FIX}"
        )
    return built
