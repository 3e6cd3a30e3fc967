"""``meshensemble.models.conv``: the reformulations equal XLA's convolution, values and grads."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshensemble as me
from meshensemble.models import CNN
from meshensemble.models import conv as conv_lib


def _xla(x, k):
    return jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


@pytest.mark.parametrize("impl", ["im2col", "canonical"])
@pytest.mark.parametrize("kernel", [(3, 3), (5, 3), (1, 1)])
def test_reformulations_match_lax_values_and_gradients(impl, kernel):
    x = jax.random.normal(jax.random.key(0), (2, 6, 7, 3))
    k = jax.random.normal(jax.random.key(1), (*kernel, 3, 4))
    loss = lambda f: lambda x, k: jnp.sum(f(x, k) ** 2)
    # one jitted program per side: run op by op, the grads cost ~10x the time in dispatch
    both = lambda f: jax.jit(lambda x, k: (f(x, k), jax.grad(loss(f), argnums=(0, 1))(x, k)))
    got, got_grads = both(conv_lib.CONV_IMPLS[impl])(x, k)
    want, want_grads = both(_xla)(x, k)
    np.testing.assert_allclose(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


def test_drop_in_falls_back_to_lax_for_what_it_does_not_cover():
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
    for strides, padding in (((1, 1), "SAME"), ((2, 2), "SAME"), ((1, 1), "VALID")):
        plain = nn.Conv(4, (3, 3), strides, padding=padding)
        params = plain.init(jax.random.key(2), x)
        want = plain.apply(params, x)
        for impl in conv_lib.CONV_CHOICES:
            drop_in = conv_lib.conv_general_dilated(impl)
            layer = nn.Conv(4, (3, 3), strides, padding=padding, conv_general_dilated=drop_in)
            got = jax.jit(layer.apply)(params, x)
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"{impl} {strides}")


def test_auto_is_canonical_on_cpu_im2col_on_gpu_and_xla_on_tpu():
    assert conv_lib.default_conv("cpu") == "canonical"
    assert conv_lib.default_conv("gpu") == "im2col"
    assert conv_lib.default_conv("tpu") == "xla"
    assert conv_lib.resolve_conv("auto") == conv_lib.default_conv(jax.default_backend())
    assert conv_lib.resolve_conv("canonical") == "canonical"


def test_auto_cnn_traces_the_canonical_convolution_on_cpu():
    x = jnp.zeros((2, 28, 28, 1))
    params = jax.eval_shape(CNN().init, jax.random.key(0), x)  # traced, never computed

    def grad_jaxpr(impl):
        loss = lambda p: CNN(conv=impl).apply(p, x).sum()
        return str(jax.make_jaxpr(jax.grad(loss))(params))

    auto = grad_jaxpr("auto")
    assert auto == grad_jaxpr("canonical")
    assert auto != grad_jaxpr("xla") and auto != grad_jaxpr("im2col")
    for impl, convs in (("im2col", 0), ("xla", 2)):
        jaxpr = str(jax.make_jaxpr(CNN(conv=impl).apply)(params, x))
        assert jaxpr.count("conv_general_dilated") == convs, impl


def test_cnn_conv_choice_keeps_parameters_and_outputs():
    x = jax.random.uniform(jax.random.key(3), (4, 28, 28, 1))
    shapes = lambda m: jax.eval_shape(lambda k: m.init(k, x[:1]), jax.random.key(0))
    params = jax.jit(CNN(conv="xla").init)(jax.random.key(0), x[:1])
    want = jax.jit(CNN(conv="xla").apply)(params, x)  # one program each, not op by op
    for impl in conv_lib.CONV_CHOICES:
        model = CNN(conv=impl)
        assert shapes(model) == shapes(CNN(conv="xla")), impl  # checkpoints carry over
        got = jax.jit(model.apply)(params, x)
        np.testing.assert_allclose(got, want, atol=2e-4, err_msg=impl)


def test_unknown_conv_is_one_line_error():
    with pytest.raises(ValueError, match=r"conv='fft' is unknown; choose one of auto, xla"):
        conv_lib.conv_general_dilated("fft")
    with pytest.raises(ValueError, match="conv='fft'"):
        CNN(conv="fft").init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_canonical_and_im2col_train_on_the_mesh_like_xla():
    """Under shard_map (check_vma: the custom VJP's cotangents) on a 4 x 2 mesh, one member
    per device: "loop" and "vmap" compute one member alike (``map_members``), so one
    strategy; several members per device, both strategies, in the gemm_grad test below."""
    strategy = "loop"
    mesh = me.make_mesh(ensemble=4, data=2, devices=jax.devices()[:8])
    x = jax.random.uniform(jax.random.key(0), (8, 8, 8, 1))
    y = jnp.arange(8) % 10

    class Net(nn.Module):
        impl: str

        @nn.compact
        def __call__(self, x):
            c = conv_lib.conv_general_dilated(self.impl)
            x = nn.relu(nn.Conv(3, (3, 3), conv_general_dilated=c)(x))
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    finals = {}
    for impl in ("xla", "im2col", "canonical"):
        ens = me.Ensemble(Net(impl), optax.sgd(0.1), 4, mesh, member_strategy=strategy)
        state = ens.init(jax.random.key(1), x[:1])
        for _ in range(2):
            state, _ = ens.train_step(state, x, y)
        finals[impl] = jax.device_get(state.params)
    for impl in ("im2col", "canonical"):
        for a, b in zip(jax.tree.leaves(finals[impl]), jax.tree.leaves(finals["xla"])):
            np.testing.assert_allclose(a, b, atol=1e-5)


GEOMETRIES = [  # the zoo's: 3x3 SAME (CNN, ResNet), 3x3 and 1x1 stride 2 (ResNet), and more
    ((1, 1), "SAME", (3, 3)),
    ((2, 2), "SAME", (3, 3)),
    ((2, 2), "SAME", (1, 1)),
    ((1, 1), "VALID", (3, 3)),
    ((1, 2), ((2, 1), (0, 1)), (3, 2)),
]


def _sin_loss(conv):
    return lambda x, k: jnp.sum(jnp.sin(conv(x, k)))


@pytest.mark.parametrize("strides,padding,kernel", GEOMETRIES)
def test_gemm_grad_matches_xla_single_and_vmapped(strides, padding, kernel):
    dn = ("NHWC", "HWIO", "NHWC")
    ref = lambda x, k: jax.lax.conv_general_dilated(x, k, strides, padding, dimension_numbers=dn)
    mine = lambda x, k: conv_lib.conv_gemm_grad(x, k, strides, padding)
    x = jax.random.normal(jax.random.key(0), (2, 9, 8, 3))
    k = jax.random.normal(jax.random.key(1), (*kernel, 3, 4))
    members = jax.random.normal(jax.random.key(3), (3, *kernel, 3, 4))
    own_x = jax.random.normal(jax.random.key(2), (3, 2, 9, 8, 3))
    grads = lambda f: jax.grad(_sin_loss(f), argnums=(0, 1))

    @functools.partial(jax.jit, static_argnums=0)  # one program per side, not op by op
    def outputs(f, x, k, members, own_x):
        """Values and gradients: single, vmapped over members' own inputs, one shared input."""
        out = {"value": f(x, k), "grads": grads(f)(x, k)}
        for name, xs, a in (("own", own_x, 0), ("shared", x, None)):
            out[f"{name} grads"] = jax.vmap(grads(f), in_axes=(a, 0))(xs, members)
            out[f"{name} value"] = jax.vmap(f, in_axes=(a, 0))(xs, members)
        return out

    got, want = (outputs(f, x, k, members, own_x) for f in (mine, ref))
    for name in want:
        for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("shared", [False, True])
def test_gemm_grad_vmapped_gradient_has_no_grouped_convolution(shared):
    x = jnp.ones((2, 8, 8, 3)) if shared else jnp.ones((4, 2, 8, 8, 3))
    kernels = jnp.ones((4, 3, 3, 3, 5))
    for impl, grouped in (("xla", True), ("gemm_grad", False)):
        f = conv_lib.CONV_IMPLS[impl]
        step = jax.vmap(jax.grad(_sin_loss(f), argnums=(0, 1)), in_axes=(None if shared else 0, 0))
        hlo = jax.jit(step).lower(x, kernels).as_text()
        assert ("feature_group_count = 4" in hlo) == grouped, impl  # xla: the test can see it
        if impl == "gemm_grad":
            assert "stablehlo.convolution" in hlo and "dot_general" in hlo
    if shared:  # the first layer: one wide convolution, kernels stacked on output features
        fwd = jax.jit(jax.vmap(conv_lib.conv_gemm_grad, in_axes=(None, 0))).lower(x, kernels)
        hlo = fwd.as_text()
        assert hlo.count("stablehlo.convolution") == 1 and "tensor<3x3x3x20xf32>" in hlo


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("strategy", ["loop", "vmap"])
def test_gemm_grad_trains_on_the_mesh_like_xla(strategy):
    """An ensemble trained with gemm_grad (4 x 2 mesh, 2 members per device) equals xla's."""
    mesh = me.make_mesh(ensemble=4, data=2, devices=jax.devices()[:8])
    x = jax.random.uniform(jax.random.key(0), (8, 8, 8, 1))
    y = jnp.arange(8) % 10

    class Net(nn.Module):
        impl: str

        @nn.compact
        def __call__(self, x):
            c = conv_lib.conv_general_dilated(self.impl)
            x = nn.relu(nn.Conv(3, (3, 3), conv_general_dilated=c)(x))
            x = nn.relu(nn.Conv(4, (3, 3), (2, 2), conv_general_dilated=c)(x))
            return nn.Dense(10)(x.reshape((x.shape[0], -1)))

    finals = {}
    for impl in ("xla", "gemm_grad"):
        ens = me.Ensemble(Net(impl), optax.sgd(0.1), 8, mesh, member_strategy=strategy)
        state = ens.init(jax.random.key(1), x[:1])
        for _ in range(3):
            state, _ = ens.train_step(state, x, y)
        finals[impl] = jax.device_get(state.params)
    for a, b in zip(jax.tree.leaves(finals["gemm_grad"]), jax.tree.leaves(finals["xla"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def zeros_state(ens, sample):
    """A state of ``ens``'s shapes, all zeros, without compiling the initialisation."""
    shapes = jax.eval_shape(ens.init, jax.random.key(0), sample)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def grouped_convolutions(conv: str, members: int = 8) -> set[int]:
    """The ``feature_group_count`` values above 1 in the lowered members-batched CNN step
    (``members`` on one device, vmapped as on a GPU)."""
    mesh = me.make_mesh(1, 1, devices=jax.devices()[:1])
    ens = me.Ensemble(
        CNN(conv=conv),
        optax.sgd(0.1, 0.9),
        members,
        mesh,
        member_strategy=me.default_strategy("gpu"),
    )
    x, y = jnp.zeros((16, 28, 28, 1)), jnp.zeros((16,), jnp.int32)
    text = ens.train_step_fn().lower(zeros_state(ens, x[:1]), x, y).as_text()
    return {int(n) for n in re.findall(r"feature_group_count = (\d+)", text)} - {1}


def test_the_gpu_configuration_lowers_to_no_grouped_convolution_over_members():
    """A CPU proxy for the GPU: vmapped members with the GPU's default convolution lower to
    no grouped convolution; XLA's convolution would (the check can see one)."""
    assert me.default_strategy("gpu") == "vmap"
    assert grouped_convolutions(conv_lib.default_conv("gpu")) == set()
    assert grouped_convolutions("xla", members=4) == {4}
