"""A lone decode's RMSNorm on GPUs (pallas_kernels/gpu/rms_norm.py): against the model's norm in Pallas
interpret mode, lowered to Triton, and what the model's norm runs where."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.models.norm import rms_norm
from pallas_kernels.gpu.rms_norm import rms_norm_row

from accelerators import lowering_for

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("hidden", [4096, 3584, 576, 64])  # one chunk; 7 of 512; 9 of 64; one
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_matches_the_models_norm_bit_for_bit_in_interpret_mode(hidden, dtype):
    x = (3 * jax.random.normal(jax.random.key(hidden), (1, hidden))).astype(dtype)
    weight = (1 + 0.1 * jax.random.normal(jax.random.key(1), (hidden,))).astype(dtype)
    out = rms_norm_row(x, weight, 1e-5, interpret=True)
    expected = rms_norm(x, weight, 1e-5)  # (on this CPU: XLA's ops)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_the_kernel_takes_one_row_only():
    with pytest.raises(ValueError, match="single row"):
        rms_norm_row(jnp.ones((2, 64)), jnp.ones(64), 1e-5, interpret=True)


def lowered(fn, *shapes) -> str:
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    with lowering_for("cuda"):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_models_norm_of_one_row_lowers_to_the_triton_kernel_on_gpus():
    """One row: the kernel; two or more (XLA makes those one kernel itself) and every CPU: XLA's ops."""
    norm = lambda x, w: rms_norm(x, w, 1e-5)  # noqa: E731
    assert lowered(norm, (1, 3584), (3584,)).count(TRITON_CALL) == 1
    assert lowered(norm, (1, 1, 4096), (4096,)).count(TRITON_CALL) == 1
    assert TRITON_CALL not in lowered(norm, (2, 4096), (4096,))
    cpu = jax.jit(norm).trace(jnp.ones((1, 64)), jnp.ones(64)).lower().as_text()
    assert TRITON_CALL not in cpu and "custom_call" not in cpu
