"""The summary of a benchmarks/gpu/run.sh run, as Markdown, from what its stages left in OUT.

python benchmarks/gpu/summary.py gpu-out > gpu-out/summary.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def tail(path: Path, lines: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []


def section(title: str, lines: list[str]) -> str:
    body = "\n".join(lines) if lines else "(nothing: the stage did not run or wrote nothing)"
    return f"\n## {title}\n\n{body}\n"


def stages(out: Path) -> list[str]:
    rows = [line.split("\t") for line in tail(out / "stages.tsv", 100)[1:]]
    return ["| stage | result | seconds |", "| --- | --- | --- |", *(f"| {' | '.join(row)} |" for row in rows)]


def serving(out: Path) -> list[str]:
    rows = ["| concurrency | ok / failed | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms |",
            "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    runs = sorted(out.glob("serve-c*.json"), key=lambda p: int(re.findall(r"\d+", p.stem)[0]))
    for path in runs:
        s = json.loads(path.read_text())
        rows.append(
            f"| {path.stem.removeprefix('serve-c')} | {s['successful requests']} / {s['failed requests']} "
            f"| {s['output throughput tok/s']:.1f} | {s['median TTFT ms']:.1f} / {s['p99 TTFT ms']:.1f} "
            f"| {s['median TPOT ms']:.2f} / {s['p99 TPOT ms']:.2f} | {s['p99 ITL ms']:.2f} |"
        )
        if "first error" in s:
            rows.append(f"\nfirst error at concurrency {path.stem}: {s['first error']}")
    return rows if runs else []


def main() -> None:
    out = Path(sys.argv[1])
    parts = ["# GPU run", "", *stages(out)]
    parts.append(section("Machine", tail(out / "env.log", 12)))
    parts.append(section("GPU hardware tests", [line for line in tail(out / "tests.log", 40) if line.strip()][-6:]))
    profile = [line for line in tail(out / "profile.log", 200) if line.startswith(("|", "decode batch", "longest"))]
    parts.append(section("Where a decode step's device time goes (step_profile.py)", profile))
    parts.append(section("Decode and prefill against the roofline (roofline.py)", tail(out / "roofline.log", 12)))
    parts.append(section("Attention kernels (attention_kernels.py)", tail(out / "kernels.log", 6)))
    tuned = [line for line in tail(out / "tune.log", 400) if line.startswith(("decode:", "prefill:", "device:"))]
    parts.append(section("Triton launch settings searched (attention_kernels.py --tune; tuned.json)", tuned))
    parts.append(section("Serving (jserve serve, serve.py)", serving(out) or tail(out / "serve.log", 15)))
    moe = [line for line in tail(out / "moe.log", 400) if not re.match(r"tokens +\d|   failed", line)]  # (not tries)
    parts.append(section("Mixture-of-experts projection (grouped_matmul.py: float, int8, --tune)", moe))
    parts.append(section("Colab demo notebook", tail(out / "notebook.log", 8)))
    parts.append(section("New weights (weight_update.py)", tail(out / "weights.log", 14)))
    parts.append(section("LoRA adapters (lora.py)", tail(out / "lora.log", 5)))
    print("\n".join(parts))


if __name__ == "__main__":
    main()
