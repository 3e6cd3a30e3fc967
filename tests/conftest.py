"""Test setup: 8 fake CPU devices, set once before JAX initialises its backends."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import functools  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Random numbers: JAX's default mode (partitionable threefry), the one users' code, the CLI
# and the library all run in; nothing here changes it.


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


@pytest.fixture
def mock_tfds():
    """``tfds.testing.mock_data`` with random examples, working around a TFDS mock bug.

    TFDS 4.9.x's mock sets ``__getitems__`` on a MagicMock as a plain attribute (it is not
    one of the magic methods mock supports), so the mocked ArrayRecord source is not
    passed as ``self`` and batched reads fail. Binding it here fixes that.
    """
    tfds = pytest.importorskip("tensorflow_datasets")
    from tensorflow_datasets.testing import mocking

    class BoundDataSourceMock(mocking.PickableDataSourceMock):
        def __setattr__(self, name, value):
            if name == "__getitems__" and isinstance(value, functools.partial):
                value = functools.partial(value, self)
            super().__setattr__(name, value)

    def mock(num_examples: int = 20):
        return tfds.testing.mock_data(
            num_examples=num_examples,
            policy=tfds.testing.MockPolicy.USE_CODE,
            mock_array_record_data_source=BoundDataSourceMock(),
        )

    return mock


class Tiny(nn.Module):
    """A small conv + dense net on 8x8 inputs: cheap, but has a convolution."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(10)(x)
