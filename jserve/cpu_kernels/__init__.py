"""jserve's CPU kernels: C++ behind XLA's FFI, built on first use with the system compiler.

paged_attention.cc is the ragged paged attention of the `cpu` attention backend; int8_linear.cc the
projections of --quantization int8 (with AVX-512 VNNI); gguf_linear.cc projections and lookups of weights
kept in GGUF's block formats (gguf_tiles*.cc: with AVX-512 VNNI or AVX2); lora.cc the products of LoRA
adapters, each token with its own; zero_pages.cc allocates the KV cache and write_kv.cc writes into it. The
sources are compiled together, once per machine, source, compiler and jaxlib, with -march=native, into
$JSERVE_CACHE/kernels/, and registered as XLA custom calls. Without a C++ compiler `available()` is False
and the CPU runs the plain-JAX attention and XLA's int8 dot instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jserve.paths import cache_dir

log = logging.getLogger("jserve")

SOURCES = sorted(Path(__file__).parent.glob("*.cc"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
TARGETS = {  # XLA name: exported symbol
    "jserve_ragged_paged_attention": "JserveRaggedPagedAttention",
    "jserve_int8_linear": "JserveInt8Linear",
    "jserve_zero_pages": "JserveZeroPages",
    "jserve_write_kv": "JserveWriteKv",
    "jserve_gguf_linear": "JserveGgufLinear",
    "jserve_gguf_rows": "JserveGgufRows",
    "jserve_lora_shrink": "JserveLoraShrink",
    "jserve_lora_expand": "JserveLoraExpand",
}
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC")
# Linked apart, without -ffast-math: with it GCC links crtfastmath.o, which switches on flush-to-zero for
# the whole process when the library loads, and the user's numpy would lose its subnormals.
LINK_FLAGS = ("-shared",)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the kernel's instantiations (AttendItem)


class KernelUnavailable(RuntimeError):
    """The kernels cannot be built here (no C++ compiler, or it failed)."""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> str:
    """The CPU's feature flags: a library built with -march=native runs only where they hold."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def cpu_has(feature: str) -> bool:
    """Whether /proc/cpuinfo lists this feature flag (e.g. "avx2") for the CPU."""
    return feature in _cpu_flags().split()


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    for part in (compiler, " ".join(COMPILE_FLAGS + LINK_FLAGS), jax.__version__, platform.machine(), _cpu_flags()):
        key.update(part.encode())
    return cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The kernels' shared library, compiled unless this machine's cache already holds it."""
    compiler = _compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    library = _library_path(compiler)
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    log.info("Building jserve's CPU kernels with %s", compiler)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        compile_library(compiler, SOURCES, built)
        os.replace(built, library)  # atomic: concurrent builders each publish a whole library
    return library


def compile_library(compiler: str, sources: list[Path], library: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """`sources` compiled (with `extra_flags` after ours: the tests build for narrower instruction sets) and
    linked into `library`, objects beside it. Compiled and linked apart: linked with -ffast-math, the library
    would turn on flush-to-zero for the whole process when it loads."""
    objects = [library.parent / f"{source.stem}.o" for source in sources]
    for source, obj in zip(sources, objects, strict=True):
        flags = (*COMPILE_FLAGS, *extra_flags, f"-I{jax.ffi.include_dir()}")
        _run([compiler, *flags, "-c", str(source), "-o", str(obj)])
    _run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(library)])


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        raise KernelUnavailable("building jserve's CPU kernels failed:\n" + "\n".join(errors[:10]))


@functools.cache
def load() -> ctypes.CDLL:
    """Build the kernels if needed and register them with XLA, once per process; KernelUnavailable if they
    cannot be."""
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return library


@functools.cache
def available() -> bool:
    try:
        load()
    except KernelUnavailable as error:
        log.warning("%s; the CPU runs the plain-JAX attention and XLA's int8 dot instead", error)
        return False
    return True


def supports(dtype, head_dim: int) -> bool:
    """Whether the kernel takes these pages (float32 or bfloat16); others go to the reference."""
    return dtype in (jnp.float32, jnp.bfloat16) and head_dim in SUPPORTED_HEAD_DIMS


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    context_lens: jax.Array,
    page_tables: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    target: str = "jserve_ragged_paged_attention",
) -> jax.Array:
    """The attention contract's attend half (the pages already hold this step's K/V), for pages that
    `supports` takes. `target`: the XLA name of the build to call (the tests register narrower ones)."""
    load()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        context_lens,
        page_tables,
        query_start_loc,
        scale=np.float32(scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    ).astype(q.dtype)


@functools.cache
def int8_linear_available() -> bool:
    """Whether int8_linear runs here: the kernels build, and the CPU has AVX-512 VNNI."""
    return available() and bool(load().JserveInt8LinearSupported())


@functools.cache
def gguf_tiles_instructions() -> str | None:
    """The vector instructions gguf_linear multiplies the tiled formats (gguf_tiles.h) with here ("AVX-512
    VNNI" or "AVX2"), or None where it runs scalar loops (or the kernels do not build)."""
    if not available():
        return None
    vectorized = load().JserveGgufTilesVectorized
    vectorized.restype = ctypes.c_char_p
    name = vectorized()
    return name.decode() if name else None


def int8_linear(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    real_rows: jax.Array | None = None,
    norm: tuple[jax.Array, float] | None = None,
    group: int = 0,
) -> jax.Array:
    """x [tokens, in] float32 times the int8 weight q, in quantization.tile's tiles, with its float32 scale
    per output -> [tokens, out] float32. `real_rows` (int32 [1]): only x's first rows are real; the other
    rows' outputs are zeros, and cost nothing. `norm` (weight [in], eps): x goes through that RMSNorm first
    (norm.rms_norm's math). `group`: 0 quantizes x as two digits per row, 32 as one digit per 32 inputs
    (quantization.py)."""
    load()
    if real_rows is None:
        real_rows = jnp.full((1,), x.shape[0], jnp.int32)
    norm_weight, eps = norm if norm is not None else (jnp.zeros((0,), jnp.float32), 0.0)
    call = jax.ffi.ffi_call("jserve_int8_linear", jax.ShapeDtypeStruct((x.shape[0], scale.shape[0]), jnp.float32))
    operands = (x, real_rows.astype(jnp.int32).reshape(1), norm_weight.astype(jnp.float32), q, scale)
    return call(*operands, eps=np.float32(eps), group=np.int64(group))


def gguf_linear(
    x: jax.Array,
    w: jax.Array,
    segments: tuple[tuple[int, int], ...],
    real_rows: jax.Array | None = None,
    norm: tuple[jax.Array, float] | None = None,
) -> jax.Array:
    """x [tokens, in] float32 times a weight in GGUF block formats -> [tokens, out] float32. `w`: the rows'
    bytes (uint8, flat), `segments`: (ggml type, rows) of each run of rows, in order. `real_rows`, `norm`: as
    int8_linear's."""
    load()
    if real_rows is None:
        real_rows = jnp.full((1,), x.shape[0], jnp.int32)
    norm_weight, eps = norm if norm is not None else (jnp.zeros((0,), jnp.float32), 0.0)
    outputs, layout = _segments(segments)
    call = jax.ffi.ffi_call("jserve_gguf_linear", jax.ShapeDtypeStruct((x.shape[0], outputs), jnp.float32))
    operands = (x.astype(jnp.float32), real_rows.astype(jnp.int32).reshape(1), norm_weight.astype(jnp.float32), w)
    return call(*operands, eps=np.float32(eps), **layout)


def _segments(segments: tuple[tuple[int, int], ...]) -> tuple[int, dict[str, np.ndarray]]:
    """A block weight's rows, and its segments as the kernels' `types` and `rows` attributes."""
    types, rows = (np.asarray(column, np.int64) for column in zip(*segments, strict=True))
    return int(rows.sum()), {"types": types, "rows": rows}


def gguf_rows(table: jax.Array, ggml_type: int, depth: int, ids: jax.Array) -> jax.Array:
    """Rows `ids` [N] of a table of `depth` columns in one GGUF block format (uint8, flat), dequantized ->
    [N, depth] float32."""
    load()
    call = jax.ffi.ffi_call("jserve_gguf_rows", jax.ShapeDtypeStruct((ids.shape[0], depth), jnp.float32))
    return call(table, ids.astype(jnp.int32), type=np.int64(ggml_type))


def lora_shrink(x: jax.Array, slots: jax.Array, a: jax.Array, norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """x [T, in] times each token's own slot of A [slots, W, in] -> [T, W] float32 (zeros where slots < 0).
    `norm` (weight [in], eps): x goes through that RMSNorm first (as int8_linear's)."""
    load()
    norm_weight, eps = norm if norm is not None else (jnp.zeros((0,), jnp.float32), 0.0)
    call = jax.ffi.ffi_call("jserve_lora_shrink", jax.ShapeDtypeStruct((x.shape[0], a.shape[1]), jnp.float32))
    operands = (x.astype(jnp.float32), slots.astype(jnp.int32), norm_weight.astype(jnp.float32), a.astype(jnp.float32))
    return call(*operands, eps=np.float32(eps))


def lora_expand(y: jax.Array, xa: jax.Array, slots: jax.Array, b: jax.Array, offset: int = 0) -> jax.Array:
    """y [T, Y] float32 with xa [T, R] times each token's own slot of B [slots, R, out] added to its columns
    [offset, offset + out) (rows where slots < 0 unchanged), in place: the result is y's buffer."""
    load()
    call = jax.ffi.ffi_call("jserve_lora_expand", jax.ShapeDtypeStruct(y.shape, jnp.float32),
                            input_output_aliases={0: 0})  # fmt: skip
    return call(y, xa.astype(jnp.float32), slots.astype(jnp.int32), b.astype(jnp.float32), offset=np.int64(offset))


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The rows k, v [T, kv_heads, dim] written into slots [T] (< 0: skipped) of float32 or bfloat16 pages,
    in place: the pages are the results' buffers."""
    load()
    shapes = tuple(jax.ShapeDtypeStruct(pages.shape, pages.dtype) for pages in (k_pages, v_pages))
    call = jax.ffi.ffi_call("jserve_write_kv", shapes, input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, k.astype(jnp.float32), v.astype(jnp.float32), slots.astype(jnp.int32))


def zeros(shape: tuple[int, ...], dtype, count: int) -> list[jax.Array]:
    """`count` zeroed arrays whose memory is not touched until first written (see zero_pages.cc)."""
    load()
    struct = jax.ShapeDtypeStruct(shape, dtype)
    return list(jax.jit(jax.ffi.ffi_call("jserve_zero_pages", [struct] * count))())
