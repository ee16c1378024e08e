"""Decode and prefill speed beside the device's roofline (the GPU target: >= 80 % of it at batch 1).

Decode at each `--decode-batch` B: B prompts of `--context` tokens are prefilled, then `--decode-steps`
steps in which all B sequences decode are timed on the wall clock, host work included. Prefill:
`--prefill-seqs` prompts of `--context` tokens, one output token each, timed from submission to the last
answer. The roofline time of the same work is max(bytes / bandwidth, FLOPs / peak):

- bytes: every weight once per step (an untied embedding table only the rows looked up; a tied one is
  the head, read whole), plus the K/V each sequence reads and writes;
- FLOPs: 2 per weight per token through the projections, the head for each sampled row, and
  4 * heads * head_dim per layer per (query, key) pair attended.

`--conditionals-batch B` also decodes at B on the step whose device decides its optional sampling stages
(each behind a conditional: on a GPU, part of the step's CUDA graph from CUDA 12.3, a round trip to the
host below it; jserve/engine/stages.py), the baseline for the steps the host decides them for.

It is given twice: from the device's data sheet (dense bfloat16; only for devices named in SPECS), and
from what this run measured: a jitted sum over a large array (bandwidth) and a large matmul through the
model's own projection path (FLOP/s; with int8 weights on CPU, the int8 kernel). Medians of `--repeats`,
the phases alternated.

    python benchmarks/roofline.py --model random:llama3-8b --decode-batch 1 256 --context 1024   # GPU
    python benchmarks/roofline.py --quantization w8a8 --kv-cache-dtype bfloat16 --decode-batch 1 16 \
        --context 256 --prefill-seqs 4                                                           # CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jserve import LLM, SamplingParams
from jserve.attention import kv_cache_bytes_per_token
from jserve.config import ModelConfig
from jserve.engine.args import DTYPES, KV_CACHE_DTYPES
from jserve.loader import resolve_dtype
from jserve.loader.weights import leaves_by_name
from jserve.models.quantization import QUANTIZATIONS, Quantization, int8_matmul, quantize_rows, tile, tiles_weights

# Data-sheet HBM bytes/s and dense bfloat16 FLOP/s, matched in order against jax's device_kind.
SPECS = (
    ("H200", 4.8e12, 989e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100", 3.35e12, 989e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),
    ("L4", 0.3e12, 121e12),
    ("TPU v6 lite", 1.64e12, 918e12),
    ("TPU v5 lite", 0.819e12, 197e12),
    ("TPU v5", 2.765e12, 459e12),
    ("TPU v4", 1.2e12, 275e12),
)


@dataclass(frozen=True)
class Roof:
    source: str
    bytes_per_s: float
    flops_per_s: float


@dataclass(frozen=True)
class Work:
    """What a measured stretch of steps had to move and compute."""

    bytes: float
    flops: float

    def bound(self, roof: Roof) -> tuple[float, str]:
        """(seconds at the roofline, what bounds them: "memory" or "compute")."""
        memory, compute = self.bytes / roof.bytes_per_s, self.flops / roof.flops_per_s
        return (memory, "memory") if memory >= compute else (compute, "compute")


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step costs of a loaded model, from its config and its actual weight bytes."""

    config: ModelConfig
    weight_bytes: int  # every parameter, as stored (quantized weights count their int8 bytes and scales)
    embedding_bytes: int  # the input table, when it is not also the head (else 0)
    kv_bytes_per_token: int  # all layers, K and V

    @classmethod
    def of(cls, llm: LLM) -> ModelCost:
        model = llm.engine.model
        leaves = leaves_by_name(model.params)
        untied = "lm_head.weight" in leaves
        embedding = sum(x.nbytes for name, x in leaves.items() if name.startswith("embed_tokens.")) if untied else 0
        return cls(model.config, sum(x.nbytes for x in leaves.values()), embedding,
                   kv_cache_bytes_per_token(model.config, llm.engine.config.kv_cache_dtype))  # fmt: skip

    def weights_read(self, rows: int) -> float:
        """Weight bytes one step reads when `rows` tokens look up the embedding table."""
        vocab = self.config.vocab_size
        return self.weight_bytes - self.embedding_bytes + self.embedding_bytes * min(rows, vocab) / vocab

    @property
    def projection_flops(self) -> int:
        """FLOPs of one token through every layer's projections."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size  # q/k/v in, o out
        return 2 * c.num_layers * (attention + 3 * c.hidden_size * c.intermediate_size)

    @property
    def head_flops(self) -> int:
        return 2 * self.config.hidden_size * self.config.vocab_size

    @property
    def pair_flops(self) -> int:
        """FLOPs of one query attending one key, in every layer (q.k and the weighted v)."""
        return 4 * self.config.num_layers * self.config.num_heads * self.config.head_dim

    def decode(self, batch: int, context: float) -> Work:
        """One step of `batch` sequences, each attending `context` keys (its K/V read, one token's written)."""
        return Work(
            self.weights_read(batch) + batch * (context + 1) * self.kv_bytes_per_token,
            batch * (self.projection_flops + self.head_flops + context * self.pair_flops),
        )

    def prefill(self, seqs: int, length: int, steps: int, tokens_per_step: int) -> Work:
        """`seqs` prompts of `length` tokens in `steps` steps; K/V written once and read once."""
        pairs = length * (length + 1) / 2
        return Work(
            steps * self.weights_read(tokens_per_step) + 2 * seqs * length * self.kv_bytes_per_token,
            seqs * (length * self.projection_flops + self.head_flops + pairs * self.pair_flops),
        )


def _median_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_roof(dtype, quantization: Quantization, probe_bytes: int, size: int) -> Roof:
    """Bandwidth of a jitted sum over `probe_bytes` of float32; FLOP/s of one [size, size] @ [size, size]
    matmul through the model's own projection path (with int8 weights, the kernel the model runs)."""
    big = jnp.ones(probe_bytes // 4, jnp.float32)
    bandwidth = big.nbytes / _median_seconds(jax.jit(jnp.sum), big)
    del big
    x, w = jax.random.normal(jax.random.key(0), (2, size, size), dtype)
    if quantization.quantized:
        q, scale = quantize_rows(w)
        q = tile(q) if tiles_weights() else q
        matmul = jax.jit(lambda x: int8_matmul(x, q, scale, group=quantization.activation_group))
    else:
        matmul = jax.jit(lambda x: x @ w.T)
    flops = 2 * size**3 / _median_seconds(matmul, x)
    return Roof(f"measured (sum over {probe_bytes >> 20} MiB; {size}^3 {quantization} matmul)", bandwidth, flops)


def spec_roof(device_kind: str) -> Roof | None:
    for name, bandwidth, flops in SPECS:
        if name in device_kind:
            return Roof(f"data sheet ({name})", bandwidth, flops)
    return None


@dataclass
class Timing:
    tokens: int
    seconds: float
    steps: int
    device_s: float
    host_s: float


def _prompts(rng, count: int, length: int, vocab: int) -> list[list[int]]:
    # Ids from the lower vocabulary: ordinary tokens, no chat control tokens.
    return rng.integers(100, min(vocab, 20000), (count, length)).tolist()


def time_decode(llm: LLM, batch: int, context: int, steps: int, rng, device_decides: bool = False) -> Timing:
    """Prefill `batch` prompts, then time `steps` steps in which every one of them decodes. The first
    prompts decode while the last are prefilled, so each may generate up to max_model_len: none finishes
    before the timed steps end (the rest are aborted). `device_decides`: steps run on the executable whose
    device decides the optional stages, each behind a conditional (where the host decides them: GPUs)."""
    engine = llm.engine
    executables = engine.runner.steps
    host_decides = executables.host_decides
    executables.host_decides = host_decides and not device_decides
    try:
        return _time_decode(engine, batch, context, steps, rng)
    finally:
        executables.host_decides = host_decides


def _time_decode(engine, batch: int, context: int, steps: int, rng) -> Timing:
    params = SamplingParams(temperature=0, max_tokens=engine.config.max_model_len - context, ignore_eos=True)
    counts = {engine.add_request(p, params): 0 for p in _prompts(rng, batch, context, engine.model.config.vocab_size)}

    def advance() -> None:
        for out in engine.step():
            counts[out.request_id] += len(out.outputs[0].delta_token_ids)

    while min(counts.values()) == 0:
        advance()
    stats = engine.sync_stats()
    before = (sum(counts.values()), stats.steps, stats.device_busy_s, stats.host_s)
    start = time.perf_counter()
    for _ in range(steps):
        advance()
    seconds = time.perf_counter() - start
    tokens = sum(counts.values()) - before[0]
    stats = engine.sync_stats()
    timing = Timing(tokens, seconds, stats.steps - before[1], stats.device_busy_s - before[2], stats.host_s - before[3])
    assert tokens == batch * steps, f"{tokens} tokens in {steps} steps of {batch} sequences"
    for request_id in counts:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return timing


def time_prefill(llm: LLM, seqs: int, context: int, rng) -> Timing:
    engine = llm.engine
    prompts = _prompts(rng, seqs, context, engine.model.config.vocab_size)
    stats = engine.sync_stats()
    before = (stats.steps, stats.device_busy_s, stats.host_s)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = engine.sync_stats()
    return Timing(
        seqs * context, seconds, stats.steps - before[0], stats.device_busy_s - before[1], stats.host_s - before[2]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model; random:llama3-8b for the GPU target")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens of every sequence")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-seqs", type=int, default=16)
    parser.add_argument(
        "--conditionals-batch", type=int, nargs="*", default=[],
        help="also decode at these batches on the step whose device decides its optional stages (GPUs: a baseline)",
    )  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--probe-mib", type=int, default=None, help="bandwidth probe size (default 4096 on accelerators, 1024 on CPU)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: what the timed steps need")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: most free memory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    probe = (args.probe_mib or (1024 if on_cpu else 4096)) << 20
    # Before the engine: its KV pool takes most of the free device memory.
    quantization = Quantization(args.quantization)
    measured = measured_roof(resolve_dtype(args.dtype), quantization, probe, 2048 if on_cpu else 8192)
    # Steps until the last prompt of the largest decode batch is prefilled (the first ones decode meanwhile).
    prefill_steps = -(-max(args.decode_batch) * args.context // args.max_num_batched_tokens) + 2
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              attention_backend=args.attention_backend, max_num_seqs=max(args.decode_batch),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len or args.context + args.decode_steps + prefill_steps + 8,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)  # fmt: skip
    cost = ModelCost.of(llm)
    roofs = [r for r in (spec_roof(device.device_kind), measured) if r]
    rng = np.random.default_rng(args.seed)

    phases = [("decode", b) for b in args.decode_batch] + [("prefill", args.prefill_seqs)]
    phases += [("decode, conditionals", b) for b in args.conditionals_batch]
    runs: dict[tuple[str, int], list[Timing]] = {p: [] for p in phases}
    for _ in range(args.repeats):  # alternated, so drifting machine load hits every phase alike
        for kind, n in phases:
            if kind.startswith("decode"):
                device_decides = kind != "decode"
                runs[kind, n].append(time_decode(llm, n, args.context, args.decode_steps, rng, device_decides))
            else:
                runs[kind, n].append(time_prefill(llm, n, args.context, rng))

    print(
        f"{device.device_kind}; {args.model or 'default model'}, {llm.engine.model.dtype.name} "
        f"{args.quantization}, K/V {llm.engine.config.kv_cache_dtype}, attention "
        f"{llm.engine.runner.attention.kernel}; weights {cost.weight_bytes / 1e9:.2f} GB, "
        f"K/V {cost.kv_bytes_per_token / 1e3:.1f} kB/token; context {args.context}"
    )
    for roof in roofs:
        print(f"roofline from {roof.source}: {roof.bytes_per_s / 1e9:.0f} GB/s, {roof.flops_per_s / 1e12:.1f} TFLOP/s")
    header = f"{'phase':24} {'tok/s':>9} {'ms/step':>8} {'device ms':>9} {'host ms':>8}"
    print(header + "".join(f" {'roof tok/s':>11} {'% roof':>7} {'bound':>8}" for _ in roofs))
    for kind, n in phases:
        timing = sorted(runs[kind, n], key=lambda t: t.tokens / t.seconds)[(args.repeats - 1) // 2]
        steps = max(timing.steps, 1)
        if kind.startswith("decode"):  # the roofline's tokens: one per sequence per step
            work, work_tokens = cost.decode(n, args.context + args.decode_steps / 2), n
        else:
            work, work_tokens = cost.prefill(n, args.context, timing.steps, args.max_num_batched_tokens), timing.tokens
        rate = timing.tokens / timing.seconds
        line = (
            f"{kind + ' ' + str(n):24} {rate:9.1f} {1000 * timing.seconds / steps:8.2f} "
            f"{1000 * timing.device_s / steps:9.2f} {1000 * timing.host_s / steps:8.2f}"
        )
        for roof in roofs:
            seconds, bound = work.bound(roof)
            best = work_tokens / seconds
            line += f" {best:11.1f} {100 * rate / best:6.1f}% {bound:>8}"
        print(line)


if __name__ == "__main__":
    main()
