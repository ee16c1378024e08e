"""Where a decode step's device time goes: a `jax.profiler` trace of a few decode steps, reduced to a table.

For each decode batch B, B prompts of `--context` tokens are prefilled, and once every sequence decodes,
`--steps` engine steps are traced. Every op the device ran is put in one kind, read off the optimized HLO of
the step's executable: the step's named scopes first (`kv_write`, `attention`, `lm_head`, `sampling`,
`prompt_scores`, `proposer`), then matrix products (dots, cuBLAS and Triton GEMMs, jserve's CPU linear
kernels), copies and transposes, and the rest (norms, RoPE, activations, residual adds, the step's own
input handling). The table gives each kind's device milliseconds per step and share, the device's busy and
idle time per step (idle: waiting for the host between and inside steps), and the ops that took longest.

On a GPU or TPU the ops are the device's kernels (their `hlo_op`); on the CPU they are XLA's thunks, which
run on several threads at once, so there a step's op times can add up to more than its wall time. The kinds
come from op names, which JAX's compilation cache leaves out of its keys unless told otherwise: the script
tells it, so an executable cached by an older jserve is compiled again rather than read without its scopes.

    python benchmarks/step_profile.py --model random:llama3-8b --batch 1 64 --context 1024   # GPU
    python benchmarks/step_profile.py --batch 1 16 --context 256                              # CPU: default model
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import numpy as np

from jserve import LLM, SamplingParams

# Named in the step (jax.named_scope): an op's kind is the first of these its name path holds.
SCOPES = ("kv_write", "attention", "norm", "rope", "lm_head", "sampling", "prompt_scores", "proposer", "experts",
          "routing")  # fmt: skip
KINDS = (*SCOPES, "matmul", "copy", "other")
MATMUL_TARGETS = re.compile(r"cublas|gemm|matmul|jserve_gguf_linear|jserve_int8_linear|dot", re.IGNORECASE)
CONTROL_FLOW = {"conditional", "while", "call"}  # on the CPU their thunks hold their branches' thunks
CPU_BOOKKEEPING = re.compile(r"^(ThunkExecutor::|end: |ThreadpoolListener)")


@dataclass
class Op:
    opcode: str
    kind: str
    op_name: str


def split_instruction(line: str) -> tuple[str, str, str, str] | None:
    """(name, result shape, opcode, rest) of an HLO instruction line, or None."""
    match = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$", line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                shape, rest = rest[: i + 1], rest[i + 1 :].lstrip()
                break
    else:
        shape, _, rest = rest.partition(" ")
    opcode = re.match(r"([a-z][\w\-]*)\(", rest)
    return (name, shape, opcode.group(1), rest) if opcode else None


def op_kinds(hlo_text: str) -> dict[str, Op]:
    """Every instruction of an optimized HLO module by name, with its kind."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)  # (computations start unindented)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif line.strip() == "}":
            current = None
        elif current is not None and (parsed := split_instruction(line)):
            name, _, opcode, rest = parsed
            current.append((name, opcode, rest))
    has_dot = {name: any(op in ("dot", "convolution") for _, op, _ in body) for name, body in computations.items()}
    ops: dict[str, Op] = {}
    for body in computations.values():
        for name, opcode, rest in body:
            op_name = (re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1]
            called = re.findall(r"calls=%?([\w.\-]+)", rest)
            target = (re.search(r'custom_call_target="([^"]*)"', rest) or [None, ""])[1]
            path = op_name.split("/")
            scope = next((s for s in SCOPES if s in path), None)
            if scope is not None:
                kind = scope
            elif _is_matmul(opcode, called, target, rest, has_dot):
                kind = "matmul"
            elif opcode in ("copy", "transpose", "copy-start", "copy-done") or re.match(r"(copy|transpose)", name):
                kind = "copy"
            else:
                kind = "other"
            ops[name] = Op(opcode, kind, op_name)
    return ops


def _is_matmul(opcode: str, called: list[str], target: str, rest: str, has_dot: dict[str, bool]) -> bool:
    """A dot, a fusion around one, or a library or jserve GEMM."""
    if opcode in ("dot", "convolution") or any(has_dot.get(c, False) for c in called) or "__triton_gemm" in rest:
        return True
    return opcode == "custom-call" and bool(MATMUL_TARGETS.search(target))


@dataclass
class OpTime:
    name: str
    start_ns: int
    duration_ns: int


def device_ops(trace_dir: Path) -> tuple[list[OpTime], str]:
    """The ops the device ran in the newest trace under trace_dir, and what they are ("kernels" or "thunks").
    A kernel is named by its `hlo_op` where the trace gives one, else by its own name; kernels of other
    executables than the engine's step (by their `hlo_module`, where given) are left out."""
    from jax.profiler import ProfileData

    path = max(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    data = ProfileData.from_file(str(path))
    devices = [plane for plane in data.planes if plane.name.startswith("/device:")]
    if devices:
        seen, ops = set(), []
        for plane in devices:
            lines = [line for line in plane.lines if line.name not in ("XLA Modules", "Steps", "XLA TraceMe")]
            named = [line for line in lines if line.name == "XLA Ops"]
            for line in named or lines:
                for event in line.events:
                    stats = dict(event.stats)
                    module = str(stats.get("hlo_module", "engine_step"))
                    name = str(stats.get("hlo_op", event.name))
                    if "engine_step" not in module or (key := (event.start_ns, name)) in seen:
                        continue
                    seen.add(key)
                    ops.append(OpTime(name, event.start_ns, event.duration_ns))
        return ops, "kernels"
    ops = []
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):
                ops += [OpTime(e.name, e.start_ns, e.duration_ns) for e in line.events
                        if not CPU_BOOKKEEPING.match(e.name)]  # fmt: skip
    return ops, "thunks"


def _busy_ns(ops: list[OpTime]) -> int:
    """The time at least one op ran (the union of their intervals)."""
    busy, end = 0, None
    for op in sorted(ops, key=lambda o: o.start_ns):
        stop = op.start_ns + op.duration_ns
        if end is None or op.start_ns >= end:
            busy += op.duration_ns
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


@dataclass
class Profile:
    batch: int
    steps: int
    wall_ms: float  # per step, on the host's clock
    busy_ms: float  # per step: some op running on the device
    idle_ms: float  # per step: the traced stretch minus busy
    kinds: dict[str, tuple[float, int]] = field(default_factory=dict)  # kind: (ms per step, ops per step)
    top: list[tuple[str, str, float, str]] = field(default_factory=list)  # (op, kind, ms per step, op_name)
    unmatched: int = 0  # ops neither in the step's HLO nor known library kernels (other executables)
    unmatched_names: list[str] = field(default_factory=list)  # the longest-running of them


def reduce_trace(ops: list[OpTime], kinds: dict[str, Op], steps: int, wall_s: float, batch: int) -> Profile:
    named = [(_kind_of(op.name, kinds), op) for op in ops]
    known = [(named_kind, op) for named_kind, op in named if named_kind is not None]
    unknown, unmatched = collections.Counter(), 0
    for named_kind, op in named:
        if named_kind is None and _hlo_name(op.name, kinds) is None:  # (control flow is known, and not counted)
            unknown[op.name] += op.duration_ns
            unmatched += 1
    span = (max(o.start_ns + o.duration_ns for _, o in known) - min(o.start_ns for _, o in known)) if known else 0
    busy = _busy_ns([o for _, o in known])
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    by_op: dict[tuple[str, str], int] = collections.defaultdict(int)
    for (name, kind), op in known:
        by_kind[kind][0] += op.duration_ns
        by_kind[kind][1] += 1
        by_op[name, kind] += op.duration_ns
    per_step = 1e6 * steps
    top = sorted(by_op.items(), key=lambda item: -item[1])[:12]
    return Profile(
        batch,
        steps,
        1000 * wall_s / steps,
        busy / per_step,
        (span - busy) / per_step,
        {kind: (by_kind[kind][0] / per_step, by_kind[kind][1] / steps) for kind in KINDS if kind in by_kind},
        [(name, kind, ns / per_step, kinds[name].op_name[-80:] if name in kinds else "") for (name, kind), ns in top],
        unmatched,
        [name for name, _ in unknown.most_common(5)],
    )


# Kernels a trace may name by themselves rather than by their HLO op: libraries' GEMMs, Pallas kernels
# (attention and its merge, a single row's norm), copies.
LIBRARY_KERNELS = ((re.compile(r"grouped_matmul", re.IGNORECASE), "experts"),
                   (re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|gmma", re.IGNORECASE), "matmul"),
                   (re.compile(r"attention", re.IGNORECASE), "attention"),
                   (re.compile(r"rms_norm", re.IGNORECASE), "norm"),
                   (re.compile(r"memcpy|memset", re.IGNORECASE), "copy"))  # fmt: skip


def _hlo_name(name: str, kinds: dict[str, Op]) -> str | None:
    """The HLO instruction an op event is of: CPU thunks of cloned branches carry a `.clone` suffix or not, and
    GPU kernels may be named after their instruction with `_` for its `.`."""
    for candidate in (name, name.removesuffix(".clone"), name + ".clone", re.sub(r"_(\d+)$", r".\1", name)):
        if candidate in kinds:
            return candidate
    return None


def _kind_of(name: str, kinds: dict[str, Op]) -> tuple[str, str] | None:
    """(the op's name in the table, its kind), or None for an op this step's HLO and the library patterns
    do not know."""
    if (hlo := _hlo_name(name, kinds)) is not None:
        return (hlo, kinds[hlo].kind) if kinds[hlo].opcode not in CONTROL_FLOW else None
    return next(((name, kind) for pattern, kind in LIBRARY_KERNELS if pattern.search(name)), None)


def profile_decode(llm: LLM, batch: int, context: int, steps: int, rng) -> Profile:
    """Prefill `batch` prompts, step until each decodes, then trace `steps` steps."""
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=engine.config.max_model_len - context, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in rng.integers(100, min(vocab, 20000), (batch, context)).tolist()]
    started: set[str] = set()
    while len(started) < batch:
        started |= {out.request_id for out in engine.step() if out.outputs[0].delta_token_ids}
    for _ in range(3):  # steady state: every row decodes, the step in flight is a decode
        engine.step()
    bucket = engine.runner.bucket_for(batch)
    kinds = {}  # (the bucket's executables: one, or on a GPU one per combination of stages steps needed)
    for (executable_bucket, _), executable in engine.runner.executables.items():
        if executable_bucket == bucket:
            kinds |= op_kinds(executable.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.block_until_ready(engine.runner.sampled)
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                engine.step()
            jax.block_until_ready(engine.runner.sampled)
        wall = time.perf_counter() - start
        ops, _ = device_ops(Path(trace_dir))
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return reduce_trace(ops, kinds, steps, wall, batch)


def print_profile(profile: Profile, what: str) -> None:
    print(f"\ndecode batch {profile.batch}: {profile.steps} steps traced, {profile.wall_ms:.2f} ms/step on the host's "
          f"clock (tracing included); device busy {profile.busy_ms:.2f} ms/step, idle {profile.idle_ms:.2f} ms/step; "
          f"{profile.unmatched} ops of other executables left out")  # fmt: skip
    if profile.unmatched_names:
        print(f"(the longest of those: {', '.join(profile.unmatched_names)})")
    print(f"| kind | ms/step | share | {what}/step |\n| --- | --- | --- | --- |")
    total = sum(ms for ms, _ in profile.kinds.values()) or 1.0
    for kind, (ms, count) in profile.kinds.items():
        print(f"| {kind} | {ms:.3f} | {100 * ms / total:.1f} % | {count:.1f} |")
    print(f"\nlongest ops (batch {profile.batch}):\n| op | kind | ms/step | op_name |\n| --- | --- | --- | --- |")
    for name, kind, ms, op_name in profile.top:
        print(f"| {name} | {kind} | {ms:.3f} | {op_name} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model; random:llama3-8b for the GPU")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: what the traced steps need")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: most free memory)")
    parser.add_argument("--json", default=None, help="also write the profiles to this file")
    args = parser.parse_args()

    # Op names are not part of the compilation cache's key by default: an executable cached before a scope was
    # added would come back without it.
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    prefill_steps = -(-max(args.batch) * args.context // args.max_num_batched_tokens) + 2
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len or args.context + args.steps + prefill_steps + 16,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)  # fmt: skip
    device = jax.devices()[0]
    print(f"{device.device_kind}; {args.model or 'default model'}, {llm.engine.model.dtype.name}, attention "
          f"{llm.engine.runner.attention.kernel}; context {args.context}")  # fmt: skip
    rng = np.random.default_rng(0)
    what = "ops" if device.platform == "cpu" else "kernels"
    profiles = [profile_decode(llm, batch, args.context, args.steps, rng) for batch in args.batch]
    for profile in profiles:
        print_profile(profile, what)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in profiles], indent=1))


if __name__ == "__main__":
    main()
