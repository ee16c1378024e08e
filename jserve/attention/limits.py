"""What the Pallas attention kernels can run, checked once at start-up against the engine's settings.

A setting a kernel cannot take fails here with the values that would fit (ValueError), or, under `auto`,
moves to a backend that runs it (logged), instead of failing in the warm-up's compilation or on hardware:

- TPU: the Mosaic kernel's SMEM (`pallas_kernels.tpu.smem_bytes`): the largest step's row metadata and two
  page-table rows of max_model_len / page_size pages, within SMEM_SHARE of a core's SMEM.
- GPU: the Triton kernel's block shapes (`pallas_kernels.gpu.supports`): page_size and head_dim powers of
  two, head_dim >= 16. The Mosaic GPU kernel hands it the models it does not take, so they are checked too.
  A page_size that does not fit is refused under any backend (a power of two below it fits); a head_dim,
  the model's own, runs the plain-JAX reference under `auto`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from jserve.attention.backend import Kernel, resolve_attention_backend

log = logging.getLogger("jserve")

# The share of a TPU core's SMEM the kernel plans on: Mosaic keeps scalars of its own there. vLLM's TPU
# backend sizes its block tables to half of SMEM for the same reason (vllm-project/vllm#16871).
SMEM_SHARE = 0.5


def fit_attention_backend(
    name: str,
    platform: str,
    *,
    head_dim: int,
    page_size: int,
    kv_cache_dtype: str,
    max_model_len: int,
    num_tokens: int,
    max_num_seqs: int,
    smem_bytes: int,
) -> str:
    """The attention_backend the engine runs for `name` on `platform`: `name`, or "reference" where `auto`'s
    GPU kernel cannot take the model's head_dim. num_tokens: the largest step's (max_num_batched_tokens);
    smem_bytes: a TPU core's SMEM."""
    if name == "auto" and platform == "cpu":
        return name  # the CPU kernel or the reference: any shape
    kernel = resolve_attention_backend(name, platform).kernel
    if kernel == Kernel.PALLAS_TPU:
        check_tpu_smem(max_model_len=max_model_len, page_size=page_size, num_tokens=num_tokens,
                       max_num_seqs=max_num_seqs, smem_bytes=smem_bytes)  # fmt: skip
    if kernel == Kernel.PALLAS_MOSAIC_GPU:
        from pallas_kernels import mosaic_gpu

        if mosaic_gpu.supports(kv_cache_dtype, page_size=page_size, head_dim=head_dim):
            return name
    if kernel in (Kernel.PALLAS_GPU, Kernel.PALLAS_MOSAIC_GPU):
        return _fit_triton(name, page_size, head_dim)
    return name


def check_tpu_smem(*, max_model_len: int, page_size: int, num_tokens: int, max_num_seqs: int, smem_bytes: int) -> None:
    """Raise ValueError, naming a max_model_len or max_num_seqs that fits, if the TPU kernel's SMEM for the
    largest step (num_tokens tokens in min(num_tokens, max_num_seqs) sequence slots) exceeds its share."""
    from pallas_kernels import tpu

    budget = int(SMEM_SHARE * smem_bytes)
    max_pages = -(-max_model_len // page_size)

    def need(pages: int, seqs: int) -> int:
        return tpu.smem_bytes(num_tokens, min(num_tokens, seqs), pages)

    if need(max_pages, max_num_seqs) <= budget:
        return
    fits = []
    if pages := _largest(lambda p: need(p, max_num_seqs) <= budget, max_pages):
        fits.append(f"max_model_len <= {pages * page_size}")
    if seqs := _largest(lambda s: need(max_pages, s) <= budget, max_num_seqs):
        fits.append(f"max_num_seqs <= {seqs}")
    raise ValueError(
        f"the TPU attention kernel needs {need(max_pages, max_num_seqs)} bytes of SMEM for max_model_len "
        f"{max_model_len} (page_size {page_size}), max_num_seqs {max_num_seqs} and max_num_batched_tokens "
        f"{num_tokens}, over the {budget} it may use ({SMEM_SHARE:.0%} of {smem_bytes}); "
        + (" or ".join(fits) + " fits" if fits else "lower max_num_batched_tokens")
    )


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in [0, upper] with fits(n), for a fits that holds up to some n and not beyond (0: none)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _fit_triton(name: str, page_size: int, head_dim: int) -> str:
    from pallas_kernels import gpu

    if gpu.supports(page_size=page_size, head_dim=head_dim):
        return name
    problem = (
        f"the Triton attention kernel needs {gpu.SHAPE_REQUIREMENT}; page_size is {page_size} and the "
        f"model's head_dim {head_dim}"
    )
    smaller_page = 1 << (page_size.bit_length() - 1)
    if gpu.supports(page_size=smaller_page, head_dim=head_dim):
        raise ValueError(f"{problem}: page_size {smaller_page} fits")
    if name != "auto":
        raise ValueError(f"{problem}: attention_backend 'reference' (or 'auto', which picks it) runs this model")
    log.warning("%s: attention runs the plain-JAX reference instead (slower)", problem)
    return "reference"
