"""Pluggable pieces named ``"module:attr"``: one resolver for every flag that takes one.

``--task module:Class`` (and, later, any other piece a user writes outside the package)
names an object by its module and attribute; :func:`load_object` imports it or says in
one line why it cannot.

Example:
  >>> load_object("collections:OrderedDict", "task").__name__
  'OrderedDict'
"""

from __future__ import annotations

import importlib
from typing import Any


def load_object(spec: str, what: str) -> Any:
    """The object ``spec = "package.module:name"`` names (``name`` may be dotted).

    Args:
      spec: ``"module:attr"``.
      what: what the object is for (the flag's name, for messages).

    Returns:
      The attribute.

    Raises:
      ValueError: a spec without exactly one ``:``, a module that does not import (its
        error quoted), or no such attribute.

    Example:
      >>> load_object("os.path:join", "task")("a", "b")
      'a/b'
    """
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr or ":" in attr:
        raise ValueError(f"{what}={spec!r}: give module:Name, e.g. my_tasks:Poisson")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as err:  # a user's module: any import error is one line
        msg = " ".join(str(err).split())
        raise ValueError(
            f"{what}={spec!r}: module {module!r} does not import ({type(err).__name__}: {msg}); "
            "check the name and that its folder is on PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}={spec!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
