"""The attention contract every backend implements, and the choice of backend.

One call per layer and step: write the step's new K/V [T, kv_heads, head_dim] into their slots
(meta.slot_mapping), then attend the flat, ragged query tokens q [T, heads, head_dim] to their own
sequence's pages: causal within each sequence, GQA, optional sliding window and logit soft-cap.
Query tokens past query_start_loc[-1] are padding and come back as zeros.

Backends:
  reference   plain JAX (`jserve.attention.reference`); the fallback everywhere.
  cpu         the C++ kernel of `jserve.cpu_kernels` (XLA FFI, built on first use; float32 pages
              of the usual head dims, others take the reference).
  pallas      the kernels of `pallas_kernels`: the Triton-lowered kernel on GPUs, the Mosaic kernel on
              TPUs; on CPU the GPU kernel in Pallas interpret mode (slow: for tests).
  pallas-mosaic-gpu
              the Hopper kernel lowered through Mosaic GPU (`pallas_kernels.mosaic_gpu`; bfloat16/float16
              pages, head_dim 64 or 128; other models take the Triton kernel); on CPU in Pallas' GPU
              interpret mode (jax >= 0.11). Not the default: slower than Triton on an H200.
  auto        pallas on GPU and TPU; on CPU the cpu kernel, or the reference where it cannot be built.
The K/V write is an XLA scatter, in place with the cache donated; on a CPU with jserve's kernels it is
`cpu_kernels.write_kv` instead, for every backend (XLA:CPU scatters into bfloat16 pages by converting the
whole cache to float32 and back).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

import jax
from jax.sharding import Mesh, PartitionSpec

from jserve import cpu_kernels
from jserve.attention.kv_cache import KVPages
from jserve.attention.metadata import AttentionMetadata
from jserve.attention.reference import paged_attention, write_kv
from jserve.parallel import MODEL_AXIS, kv_cache_spec

ATTENTION_BACKENDS = ("auto", "reference", "cpu", "pallas", "pallas-mosaic-gpu")


class Kernel(StrEnum):
    """The attention implementation a backend name resolves to on a platform."""

    REFERENCE = "reference"
    CPU = "cpu"
    PALLAS_GPU = "pallas-gpu"  # lowered through Triton
    PALLAS_MOSAIC_GPU = "pallas-mosaic-gpu"
    PALLAS_TPU = "pallas-tpu"


@dataclass(frozen=True)
class AttentionBackend:
    """A hashable attention implementation: it is a static argument of the jitted step."""

    kernel: Kernel = Kernel.REFERENCE
    interpret: bool = False  # run the Pallas kernel in interpret mode (on CPU)
    mesh: Mesh | None = None  # tensor parallelism: each device attends its own heads (shard_map)
    num_cores: int | None = None  # the GPU's SMs, which the GPU kernels size decode splits for (None: an H100's)
    device_kind: str | None = None  # the GPU's name, which the Triton kernel's measured launch settings are for

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        pages: KVPages,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> tuple[jax.Array, KVPages]:
        """-> (attention output [T, heads, head_dim] in q's dtype, pages with the new K/V written)."""
        local = partial(_attend, backend=self, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if self.mesh is None:
            return local(q, k, v, pages, meta)
        heads = PartitionSpec(None, MODEL_AXIS, None)
        kv = KVPages(kv_cache_spec(), kv_cache_spec(), pages.num_layers)
        sharded = jax.shard_map(local, mesh=self.mesh, in_specs=(heads, heads, heads, kv, PartitionSpec()),
                                out_specs=(heads, kv), check_vma=False)  # fmt: skip
        return sharded(q, k, v, pages, meta)


# Jitted so that a step traces and lowers one layer's attention once and calls it from every layer (the
# arguments' shapes are the same): start-up tracing was mostly this, 30 times over. XLA inlines it again.
@partial(jax.jit, static_argnames=("backend", "scale", "sliding_window", "soft_cap"))
def _attend(q, k, v, pages: KVPages, meta: AttentionMetadata, *, backend, scale, sliding_window, soft_cap):
    with jax.named_scope("kv_write"):  # (scopes name the step's parts in profiles: benchmarks/step_profile.py)
        pages = _write_kv(pages, k, v, meta.slot_mapping)
    with jax.named_scope("attention"):
        return _attend_pages(q, pages, meta, backend, scale, sliding_window, soft_cap), pages


def _attend_pages(q, pages: KVPages, meta: AttentionMetadata, backend, scale, sliding_window, soft_cap):
    kernel = _kernel_for(backend.kernel, pages.k)
    # The Triton kernel adds the layer's first page as it reads the tables; the others take them shifted.
    tables = meta.page_tables if kernel == Kernel.PALLAS_GPU else meta.cache_page_tables
    if kernel == Kernel.REFERENCE:
        meta = dataclasses.replace(meta, page_tables=tables, first_page=None)
        return paged_attention(q, pages, meta, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if kernel == Kernel.CPU:
        attend = cpu_kernels.ragged_paged_attention
    else:
        attend = partial(_pallas_kernels(kernel).ragged_paged_attention, interpret=backend.interpret)
        if backend.num_cores is not None:
            attend = partial(attend, num_cores=backend.num_cores)
        if kernel == Kernel.PALLAS_GPU:
            attend = partial(attend, device_kind=backend.device_kind, page_offset=meta.first_page)
    return attend(q, pages.k, pages.v, meta.context_lens, tables, meta.query_start_loc,
                  scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)  # fmt: skip


# Imported when first used: each pulls in its Pallas backend.
PALLAS_MODULES = {
    Kernel.PALLAS_GPU: "pallas_kernels.gpu",
    Kernel.PALLAS_MOSAIC_GPU: "pallas_kernels.mosaic_gpu",
    Kernel.PALLAS_TPU: "pallas_kernels.tpu",
}


def _pallas_kernels(kernel: Kernel):
    return importlib.import_module(PALLAS_MODULES[kernel])


def _kernel_for(kernel: Kernel, pages: jax.Array) -> Kernel:
    """The kernel that runs on these pages [P, page_size, kv_heads, head_dim]: one that does not take their
    dtype or shape hands them to the nearest that does."""
    page_size, head_dim = pages.shape[1], pages.shape[-1]
    if kernel == Kernel.CPU and not cpu_kernels.supports(pages.dtype, head_dim):
        return Kernel.REFERENCE
    if kernel == Kernel.PALLAS_MOSAIC_GPU and not _pallas_kernels(kernel).supports(
        pages.dtype, page_size=page_size, head_dim=head_dim
    ):
        return Kernel.PALLAS_GPU
    return kernel


def _write_kv(pages: KVPages, k, v, slots) -> KVPages:
    """XLA's scatter; in a step lowered for the CPU, jserve's C++ write where it is built. Chosen by the
    platform the step is lowered for, not the host's default, so a CPU host can lower a GPU step."""
    if jax.default_backend() != "cpu" or not cpu_kernels.available():  # no C++ build on accelerator hosts
        return write_kv(pages, k, v, slots)
    return jax.lax.platform_dependent(pages, k, v, slots, cpu=_cpu_write_kv, default=write_kv)


def _cpu_write_kv(pages: KVPages, k, v, slots) -> KVPages:
    new_k, new_v = cpu_kernels.write_kv(pages.k, pages.v, k, v, slots)
    return dataclasses.replace(pages, k=new_k, v=new_v)


REFERENCE = AttentionBackend()
CPU = AttentionBackend(Kernel.CPU)


def resolve_attention_backend(
    name: str = "auto", platform: str | None = None, mesh: Mesh | None = None
) -> AttentionBackend:
    """The backend for a name in ATTENTION_BACKENDS on `platform` (default: JAX's default backend),
    run per device over `mesh` when the model is tensor-parallel."""
    return dataclasses.replace(_backend_for(name, platform), mesh=mesh)


def _backend_for(name: str, platform: str | None) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    platform = platform or jax.default_backend()
    if name == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only, not on {platform}")
    if name == "cpu" or (name == "auto" and platform == "cpu"):
        # auto falls back to the reference where no compiler can build the kernel; an explicit cpu raises
        return CPU if name == "cpu" or cpu_kernels.available() else REFERENCE
    if name == "reference":
        return REFERENCE
    if name == "pallas-mosaic-gpu":
        if platform == "tpu":
            raise ValueError("attention_backend 'pallas-mosaic-gpu' runs on NVIDIA GPUs (and interpreted on CPU)")
        return AttentionBackend(Kernel.PALLAS_MOSAIC_GPU, interpret=platform == "cpu", **_this_gpu(platform))
    if platform == "tpu":
        return AttentionBackend(Kernel.PALLAS_TPU)
    return AttentionBackend(Kernel.PALLAS_GPU, interpret=platform == "cpu", **_this_gpu(platform))


def _this_gpu(platform: str) -> dict:
    """The SMs and name of this host's GPU when the backend is for it; none when lowering for a GPU it does not
    have."""
    if platform != "gpu" or jax.default_backend() != "gpu":
        return {}
    device = jax.devices()[0]
    return dict(num_cores=getattr(device, "core_count", None), device_kind=device.device_kind)
