"""The engine's step compiled for a GPU or TPU on this CPU host: what the accelerator would run, read without one.

XLA compiles for an accelerator it does not have: for a GPU from a description of it (a target config)
through JAX's CUDA plugin, for a TPU from a topology through libtpu. This builds the runner's own jitted step
for random weights of an 8B shape (abstract: nothing is allocated) and compiles each step bucket for the
target, Pallas kernels included (Triton for GPUs, Mosaic for TPUs: a kernel Mosaic cannot compile fails here
as it would on the chip), then reports, per bucket:

- compile seconds, and the executable's memory: arguments, what outputs alias of them (donated state
  updated in place), temporaries;
- the kernels it launches (the entry computation's fusions, library calls and Pallas kernels) by kind, read
  off the step's named scopes (`kv_write`, `attention`, `lm_head`, `sampling`, ...) as step_profile.py does;
  control flow (`lax.cond`, loops), whose branches run as kernels of their own;
- the kernels XLA's rematerialization pass added (`*.remat*`: a value recomputed for a later use instead of
  kept), which run twice every step;
- on a GPU, how many CUDA graphs (XLA's command buffers) the step launches, and what the host launches
  outside them, one by one (XLA records kernels and, with CUDA 12.3 or later, library calls and conditionals
  into the graphs; not loops: a loop's passes are launched from the host, and where XLA does not know its
  trip count, each pass waits for the device to say whether to go on);
- whether every donated K/V array is aliased, and every copy or transpose of at least `--min-mb` MB: for
  carried state (the K/V cache, the penalty state, held logits) a copy means the buffer is copied every step
  instead of updated in place. (A TPU's asynchronous copies between HBM and VMEM, its compiler's prefetches,
  are not counted.)

The compiler plugins (the CUDA plugin with NVIDIA's ptxas, about 580 MB; libtpu, about 680 MB) are
installed on first use, for this jaxlib, into jserve's cache (`$JSERVE_CACHE/compile-plugins`, with pip, from
the package index), not into the venv, where they would wake at every `import jax` (no accelerator needed):

    python benchmarks/compiled_step.py --target h200 --buckets 1 256 2048
    python benchmarks/compiled_step.py --target tpu-v6e --buckets 1 256 2048

Without the device, XLA skips autotuning (GEMM tilings, sort scratch sizes) and picks defaults, so kernel
choices can differ in detail from a compilation on the device; buffer assignment, fusion and copies do not.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # the CUDA plugin compiles; it must not look for a device
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # (no cuDNN or driver to check on this host)
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu: no TPU VM's metadata server to ask

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (when imported by path, as the tests do)
from step_profile import op_kinds, split_instruction  # noqa: E402

from jserve.attention import KVPages, resolve_attention_backend  # noqa: E402
from jserve.config import ModelConfig  # noqa: E402
from jserve.engine.config import EngineConfig, SchedulePolicy  # noqa: E402
from jserve.engine.penalties import init_penalty_state  # noqa: E402
from jserve.engine.runner import ModelRunner  # noqa: E402
from jserve.engine.sampler import full_bitmask  # noqa: E402
from jserve.engine.stages import DEVICE_DECIDES, Gate, StepStages, host_decides, step_stages  # noqa: E402
from jserve.engine.step import init_sampled, jit_engine_step  # noqa: E402
from jserve.engine.step_packing import StepPacking  # noqa: E402
from jserve.loader import load_model  # noqa: E402
from jserve.loader.random_weights import MODEL_SHAPES  # noqa: E402
from jserve.loader.weights import abstract_model  # noqa: E402
from jserve.paths import cache_dir  # noqa: E402

# The GPUs' descriptions as XLA's GpuTargetConfig reads them (data-sheet figures; SXM parts), and TPU
# topologies as libtpu names them (a 2x2 slice: the step is compiled for its first chip). kv_gib: the K/V
# cache to compile for (48 GiB is benchmarks/gpu/run.sh's; a TPU chip holds less beside 16 GB of weights).
TARGETS = {
    "h100": dict(platform="gpu", name="NVIDIA H100 80GB HBM3", memory=80 << 30, bandwidth=3.35e12, kv_gib=40),
    "h200": dict(platform="gpu", name="NVIDIA H200", memory=141 << 30, bandwidth=4.8e12, kv_gib=48),
    "tpu-v6e": dict(platform="tpu", topology="v6e:2x2", kv_gib=8),
    "tpu-v5p": dict(platform="tpu", topology="v5p:2x2x1", kv_gib=48),
}
# Instructions of the entry computation that launch nothing: they name, split or join buffers.
NO_LAUNCH = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "after-all", "partition-id"}
CONTROL_FLOW = {"conditional", "while", "call"}
# How HloRematerialization names its clones (`gemm_fusion_dot.3.remat2`, `gte.remat.12`); not the
# `.rematerialized.N` copies of a broadcast that newer XLA makes for each user instead of one kernel of many
# outputs (kernels either way, but no work done twice).
REMAT_NAME = re.compile(r"\.remat(\d|\.|$)")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
               "u64": 8, "f64": 8}  # fmt: skip


def gpu_target_config(spec: dict) -> str:
    """An H100's or H200's GpuTargetConfig (text proto): sm_90, 132 SMs; a CUDA 12.8 runtime and driver (from
    12.3 XLA records library calls and conditionals into the step's CUDA graphs too)."""
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(spec["bandwidth"])} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {spec["memory"]} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536 registers_per_block_limit: 65536
  driver_version: "12.8.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{spec["name"]}"
"""


def use_compiler_plugin(platform: str) -> None:
    """Make the compiler plugin for `platform` importable (installed into the cache on first use). It must be
    found before JAX first looks for backends (its first `jax.devices()` or compilation)."""
    version = jaxlib.__version__
    folder = cache_dir() / "compile-plugins" / f"{platform}-jaxlib-{version}"
    if not (folder / "installed").exists():
        if platform == "gpu":
            packages = [f"jax-cuda12-plugin=={version}", f"jax-cuda12-pjrt=={version}", "nvidia-cuda-nvcc-cu12",
                        "nvidia-cuda-runtime-cu12"]  # fmt: skip
        else:  # the libtpu release jax's own `tpu` extra names for this version
            requirements = importlib.metadata.requires("jax") or []
            packages = [r.split(";")[0].strip() for r in requirements if r.startswith("libtpu") and '"tpu"' in r]
        print(f"installing the {platform} compiler plugin for jaxlib {version} into {folder}: {' '.join(packages)}")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), *packages]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"could not install the {platform} compiler plugin ({' '.join(packages)}): {done.stderr[-800:]}")
        (folder / "installed").touch()
    sys.path.insert(0, str(folder))


def target_device(target: str):
    """The (abstract) device of the target the step is compiled for."""
    spec = TARGETS[target]
    if spec["platform"] == "gpu":
        config = gpu_target_config(spec)
        return topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1").devices[0]
    return topologies.get_topology_desc(topology_name=spec["topology"], platform="tpu").devices[0]


@dataclass
class Report:
    bucket: int
    compile_s: float
    argument_gib: float
    aliased_gib: float
    temp_mib: float
    launches: dict[str, int]  # kind: kernels the entry computation launches
    control_flow: dict[str, int]  # opcode: count (their branches' kernels are not in `launches`)
    kv_aliased: bool  # every donated K/V array is updated in place
    rematerialized: dict[str, int]  # kind: launches XLA's rematerialization pass added (REMAT_NAME)
    # GPUs: the step's CUDA graphs (command buffers), and what runs outside them ("kind name", in order)
    graphs: int | None = None
    outside_graphs: list[str] = field(default_factory=list)
    # (op, MB, shape, where from: its op name, or the carried state of its shape)
    big_copies: list[tuple[str, float, str, str]] = field(default_factory=list)


def shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * DTYPE_BYTES.get(dtype, 0)
    return total


def entry_instructions(hlo: str) -> list[tuple[str, str, str, str]]:
    """(name, result shape, opcode, the rest) of each instruction of the entry computation."""
    body = hlo[hlo.index("\nENTRY") :].split("\n")[1:]
    return [parsed for line in body if (parsed := split_instruction(line))]


def aliased_parameters(hlo: str) -> set[int]:
    """The entry parameters an output aliases (donated buffers XLA writes in place)."""
    header = hlo.split("\n", 1)[0]
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
    return {int(p) for p in re.findall(r":\s*\((\d+),", alias.group(1))} if alias else set()


def parameter_names(hlo: str) -> dict[str, str]:
    """Entry parameters by result shape (`pred[256,128256]` -> `penalty_state_prompt_mask`): what a copy of
    that shape copies, since the copies XLA inserts carry no op name of their own."""
    signature = re.search(r"\nENTRY %\S+ \((.*?)\) ->", hlo).group(1)
    names: dict[str, str] = {}
    for name, shape in re.findall(r"(\w+?)(?:\.\d+)?: ([a-z]+\d*\[[\d,]*\])", signature):
        names.setdefault(shape, name)
    return names


def inspect(hlo: str, bucket: int, compile_s: float, memory, kv_params: set[int], min_mb: float) -> Report:
    kinds, parameters = op_kinds(hlo), parameter_names(hlo)
    launches: collections.Counter = collections.Counter()
    remat: collections.Counter = collections.Counter()
    control: collections.Counter = collections.Counter()
    copies = []
    for name, shape, opcode, rest in entry_instructions(hlo):
        if opcode in NO_LAUNCH:
            continue
        if opcode in CONTROL_FLOW:
            unknown_trips = opcode == "while" and "known_trip_count" not in rest
            control["while, unknown trip count" if unknown_trips else opcode] += 1
            continue
        kind = kinds[name].kind if name in kinds else "other"
        launches[kind] += 1
        if REMAT_NAME.search(name):
            remat[kind] += 1
        is_copy = opcode in ("copy", "transpose") or (
            opcode == "fusion" and re.match(r"(loop_|input_|wrapped_)?(copy|transpose)", name)
        )
        if is_copy and (megabytes := shape_bytes(shape) / 1e6) >= min_mb:
            op_name = (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1]
            origin = op_name or parameters.get(shape.split("{")[0], "")
            copies.append((name, round(megabytes, 1), shape, origin))
    return Report(
        bucket=bucket,
        compile_s=round(compile_s, 1),
        argument_gib=round(memory.argument_size_in_bytes / 2**30, 2),
        aliased_gib=round(memory.alias_size_in_bytes / 2**30, 2),
        temp_mib=round(memory.temp_size_in_bytes / 2**20, 1),
        launches=dict(launches.most_common()),
        control_flow=dict(control),
        kv_aliased=kv_params <= aliased_parameters(hlo),
        rematerialized=dict(remat.most_common()),
        big_copies=sorted(copies, key=lambda c: -c[1]),
    )


def command_buffers(dump_dir: Path, hlo: str) -> tuple[int, list[str]] | None:
    """The CUDA graphs (command buffers) in XLA:GPU's thunk sequence of the step dumped in `dump_dir`, and the
    top-level thunks between them, each as "kind instruction (op name)"; None if this XLA dumps no thunk
    sequence."""
    # (the sequence after XLA's thunk passes, which make the command buffers, is dumped only if they did)
    sequence = sorted(dump_dir.glob("*jit_engine_step*thunk_sequence_after_thunk_passes.txt")) or sorted(
        dump_dir.glob("*jit_engine_step*thunk_sequence.txt")
    )
    metadata = sorted(dump_dir.glob("*jit_engine_step*thunk_metadata.txt"))
    if not sequence:
        return None
    annotations = metadata[-1].read_text() if metadata else ""
    names = {int(i): n for n, i in re.findall(r'profile_annotation: "(.*?)"\s*thunk_id: (\d+)', annotations)}
    graphs, outside = 0, []
    for kind_id, kind in re.findall(r"^(\d+): (k\w+)", sequence[-1].read_text(), re.MULTILINE):  # (top level)
        if kind == "kCommandBuffer":
            graphs += 1
            continue
        name = names.get(int(kind_id), "")
        op_name = re.search(rf"%{re.escape(name)} = [^\n]*?op_name=\"([^\"]*)\"", hlo) if name else None
        where = re.sub(r"jit\((\w+)\)/", "", op_name.group(1)) if op_name else ""  # (scopes and primitive)
        outside.append(f"{kind[1:]} {name}{f' ({where})' if where else ''}".strip())
    return graphs, outside


def build_runner(args) -> ModelRunner:
    """A runner of a tiny model with the engine settings of the GPU run: its batch preparation is what the 8B
    step is lowered from (its own weights, cache and CPU-compiled step are never used)."""
    model = load_model("random:smollm2-135m", progress_bars=False)
    config = EngineConfig(
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, num_pages=8, seed=0,
        enable_prefix_caching=True, schedule_policy=SchedulePolicy.FCFS, attention_backend=args.attention,
        async_scheduling=True, kv_cache_dtype="bfloat16",
    )  # fmt: skip
    return ModelRunner(model, config, frozenset({0}))


def placement(target: str) -> tuple[NamedSharding, AbstractMesh]:
    """Where arrays of a program compiled for the target live (its one device), and the abstract mesh to lower
    it in: Pallas reads the chip it lowers for (its generation, its memories) off the abstract mesh in context."""
    device = target_device(target)
    platform = TARGETS[target]["platform"]
    kind = AbstractDevice(device_kind=device.device_kind, num_cores=getattr(device, "core_count", 1), platform=platform)
    context = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=kind)
    return NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec()), context


def compile_buckets(args) -> list[tuple[Report, str]]:
    platform = TARGETS[args.target]["platform"]
    on_device, context = placement(args.target)

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), tree)

    runner = build_runner(args)
    step_fn = jit_engine_step(platform=platform)  # the runner's, as a runner on the target makes it
    config = shape_layers(MODEL_SHAPES[args.shape], args.layers)
    dtype = jnp.bfloat16
    graphdef, params_tree = abstract_model(config, dtype, "none")
    params, params_def = jax.tree_util.tree_flatten(params_tree)
    page_bytes = args.page_size * config.num_kv_heads * config.head_dim * 2 * 2 * config.num_layers  # K and V
    num_pages = int((args.kv_cache_gib or TARGETS[args.target]["kv_gib"]) * 2**30) // page_bytes
    pages = jax.ShapeDtypeStruct((config.num_layers * num_pages, args.page_size, config.num_kv_heads,
                                  config.head_dim), dtype, sharding=on_device)  # fmt: skip
    kv_cache = KVPages(pages, pages, config.num_layers)
    attention = resolve_attention_backend(args.attention, platform=platform)
    vocab, rows = config.vocab_size, runner.sampled.token_ids.shape[0]
    penalties = abstract(jax.eval_shape(partial(init_penalty_state, args.max_num_seqs, vocab)))
    sampled = abstract(jax.eval_shape(partial(init_sampled, rows, vocab)))
    kv_params = {len(params), len(params) + 1}  # the entry parameters after the weights: K, then V
    run_stages = dict.fromkeys(args.run_stages, Gate.RUN)
    results = []
    for bucket in args.buckets:
        step = runner.prepare([], bucket)
        bitmask = full_bitmask(step.sampling.token_bitmask.shape[0], vocab)  # the 8B vocabulary's
        step = replace(step, sampling=replace(step.sampling, token_bitmask=bitmask))
        packing = StepPacking.of(step)
        stages = replace(step_stages(step, vocab), **run_stages)
        stages = stages if host_decides(platform) else DEVICE_DECIDES  # (as a runner on the target picks them)
        call = (graphdef, attention, params_def, None, packing, stages, abstract(params), [], None, kv_cache, (),
                penalties, sampled, abstract(packing.pack(step)))  # fmt: skip
        start = time.perf_counter()
        with jax.sharding.use_abstract_mesh(context):
            lowered = step_fn.trace(*call).lower()
        with tempfile.TemporaryDirectory() as dump_dir:
            # (on a GPU, XLA's dump of the step has its thunk sequence: how the step's kernels make CUDA graphs)
            dumps = {"xla_dump_to": dump_dir, "xla_dump_hlo_module_re": "jit_engine_step"}
            compiled = lowered.compile(dumps if platform == "gpu" else None)
            hlo = compiled.as_text()
            elapsed = time.perf_counter() - start
            report = inspect(hlo, bucket, elapsed, compiled.memory_analysis(), kv_params, args.min_mb)
            if platform == "gpu" and (grouped := command_buffers(Path(dump_dir), hlo)):
                report.graphs, report.outside_graphs = grouped
        results.append((report, hlo))
        print_report(report, config.num_layers)
    return results


def shape_layers(config: ModelConfig, layers: int | None) -> ModelConfig:
    """The shape with its first `layers` layers (None: all)."""
    if layers is None:
        return config
    return replace(config, num_layers=layers, sliding_windows=config.sliding_windows[:layers],
                   moe_layers=config.moe_layers[:layers])  # fmt: skip


def print_report(r: Report, num_layers: int) -> None:
    total = sum(r.launches.values())
    print(f"\n== bucket {r.bucket}: compiled in {r.compile_s} s; arguments {r.argument_gib} GiB, "
          f"{r.aliased_gib} GiB of them updated in place, temporaries {r.temp_mib} MiB")  # fmt: skip
    print(f"   K/V cache {'aliased (written in place)' if r.kv_aliased else 'NOT aliased: copied every step'}")
    print(f"   {total} kernel launches ({total / num_layers:.1f} per layer): "
          + ", ".join(f"{kind} {n}" for kind, n in r.launches.items()))  # fmt: skip
    if r.rematerialized:
        print(f"   rematerialized (run twice): {sum(r.rematerialized.values())} of them: "
              + ", ".join(f"{kind} {n}" for kind, n in r.rematerialized.items()))  # fmt: skip
    if r.control_flow:
        print("   control flow (branches launch kernels of their own): "
              + ", ".join(f"{op} {n}" for op, n in r.control_flow.items()))  # fmt: skip
    if r.graphs is not None:
        outside = f"; launched from the host outside them: {', '.join(r.outside_graphs)}" if r.outside_graphs else ""
        plural = "s" if r.graphs != 1 else ""
        print(f"   {r.graphs} CUDA graph{plural} (XLA command buffer{plural}){outside}")
    for name, megabytes, shape, origin in r.big_copies:
        print(f"   copy {name}: {megabytes} MB {shape}{'  (' + origin + ')' if origin else ''}")
    if not r.big_copies:
        print("   no copy or transpose of that size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=TARGETS, default="h200")
    parser.add_argument("--shape", choices=MODEL_SHAPES, default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None,
                        help="compile only the shape's first N layers (each compiles alike: quicker)")  # fmt: skip
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 256, 2048], help="step buckets (tokens)")
    parser.add_argument("--attention", default="auto", choices=["auto", "pallas", "pallas-mosaic-gpu", "reference"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1280)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="default: the target's (TARGETS)")
    parser.add_argument("--min-mb", type=float, default=1.0, help="report copies and transposes from this size")
    parser.add_argument("--run-stages", nargs="*", default=[], choices=[f.name for f in fields(StepStages)],
                        help="optional stages to compile in for a GPU (default: a greedy step's: none)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the reports here")
    parser.add_argument("--hlo-dir", default=None, help="also write each bucket's optimized HLO here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    use_compiler_plugin(TARGETS[args.target]["platform"])
    if jax.default_backend() != "cpu":
        sys.exit("run this on a host without an accelerator (it compiles for one it describes)")
    print(f"{args.shape} in bfloat16 for {target_device(args.target).device_kind} (compiled on this host), "
          f"max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens} tokens a step, "
          f"attention {args.attention}")  # fmt: skip
    results = compile_buckets(args)
    if args.hlo_dir:
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        for report, hlo in results:
            (Path(args.hlo_dir) / f"step-{report.bucket}.hlo").write_text(hlo)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(report) for report, _ in results], indent=1))


if __name__ == "__main__":
    main()
