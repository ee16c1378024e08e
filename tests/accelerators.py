"""Lowering for an accelerator this CPU host does not have.

Pallas reads the target's generation from the device of the abstract mesh in context (Mosaic the TPU's,
Triton the GPU's compute capability, which jax >= 0.12 refuses to guess without a GPU): these stand in.
"""

import jax

ABSTRACT_DEVICES = {
    "cuda": jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"),
    "tpu": jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
}


def lowering_for(platform: str):
    """A context in which a jitted function lowers for `platform` ("cuda" or "tpu") as on one such device."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=ABSTRACT_DEVICES[platform])
    return jax.sharding.use_abstract_mesh(mesh)
