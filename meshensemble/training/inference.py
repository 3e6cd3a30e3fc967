"""The temperature an inference bundle carries: a JSON file beside the saved weights.

:func:`meshensemble.save_inference` ``(path, state, temperature=T)`` writes
``path/temperature.json`` (:data:`TEMPERATURE_FILE`) after the weights;
``load_inference(path, ens, sample, with_temperature=True)`` returns it with the state.
A bundle without the file (older ones, or saved without ``temperature``) has
temperature None, i.e. the uncalibrated prediction. The file holds
``{"temperature": T}``: a number (one temperature for the pooled ensemble, what
``meshensemble evaluate --calibrate`` fits), or a list, one per member.

Example:
  >>> storage.makedirs("runs/mnist/inference")
  >>> write_temperature("runs/mnist/inference", 1.31)
  >>> read_temperature("runs/mnist/inference")
  1.31
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from meshensemble.runtime import storage

TEMPERATURE_FILE = "temperature.json"
"""Name of the temperature's file inside an inference bundle's folder."""


def check_temperature(temperature: Any) -> float | list[float] | None:
    """``temperature`` as JSON: None, a positive float, or a list of positive floats.

    Args:
      temperature: None, a scalar ``T > 0`` or ``[members]`` temperatures.

    Returns:
      None, a float, or a list of floats.

    Raises:
      ValueError: not finite, not positive, or more than one dimension (one line).

    Example:
      >>> check_temperature(np.float32(2.0))
      2.0
    """
    if temperature is None:
        return None
    t = np.asarray(temperature, np.float64)
    if t.ndim > 1 or t.size == 0:
        raise ValueError(
            f"temperature of shape {t.shape} must be a scalar or [members]; give one T or one "
            "per member"
        )
    if not all(math.isfinite(v) and v > 0 for v in t.ravel().tolist()):
        raise ValueError(f"temperature {t.tolist()} must be finite and > 0")
    return float(t) if t.ndim == 0 else [float(v) for v in t]


def write_temperature(path: str, temperature: Any) -> None:
    """Writes ``path/temperature.json`` (process 0 only); None removes an old one.

    Args:
      path: the bundle's folder (it must exist).
      temperature: None, a scalar ``T > 0`` or ``[members]`` temperatures.

    Raises:
      ValueError: a bad temperature (see :func:`check_temperature`).
      OSError: the file cannot be written.

    Example:
      >>> storage.makedirs("runs/mnist/inference")
      >>> write_temperature("runs/mnist/inference", [1.1, 1.2])
      >>> read_temperature("runs/mnist/inference")
      array([1.1, 1.2])
    """
    value = check_temperature(temperature)
    if jax.process_index() != 0:
        return
    target = storage.join(path, TEMPERATURE_FILE)
    if value is None:
        storage.remove(target)
        return
    storage.atomic_write_json(target, {"temperature": value})  # checked finite: strict


def read_temperature(path: str) -> float | np.ndarray | None:
    """The temperature a bundle carries: None when it has no ``temperature.json``.

    Args:
      path: the bundle's folder.

    Returns:
      None, a float, or a float64 numpy array ``[members]``.

    Raises:
      ValueError: the file is corrupt (one line naming it).

    Example:
      >>> storage.makedirs("runs/mnist/inference")
      >>> read_temperature("runs/mnist/inference") is None   # nothing written yet
      True
      >>> write_temperature("runs/mnist/inference", 1.31)
      >>> read_temperature("runs/mnist/inference")
      1.31
    """
    target = storage.join(path, TEMPERATURE_FILE)
    if not storage.exists(target):
        return None
    try:
        value = check_temperature(storage.read_json(target)["temperature"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(
            f"{target}: corrupt temperature ({msg}); save the bundle again with "
            "me.save_inference(path, state, temperature=T)"
        ) from None
    return np.asarray(value, np.float64) if isinstance(value, list) else value
