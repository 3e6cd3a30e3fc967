"""Test setup: 8 fake CPU devices, set once before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


def need_devices(n: int) -> None:
    """Skip the calling test when fewer than ``n`` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


MNIST_NPZ = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


@pytest.fixture
def mnist_npz() -> str:
    """Path of the full MNIST npz in ../shared/data, or skip when it is absent."""
    path = os.path.abspath(MNIST_NPZ)
    if not os.path.exists(path):
        pytest.skip(f"full MNIST not found at {path} (shared data is absent on this machine)")
    return path
