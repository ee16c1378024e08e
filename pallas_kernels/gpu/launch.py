"""How the Triton kernel's two programs are launched, and the settings measured fastest on each GPU.

The decode and prefill programs are tuned apart: a decode is bound by reading K/V (how many pages a block
loads, how many programs per SM keep loads in flight), a prefill chunk by its matrix products (how many
query tokens share each K/V block). `tuned.json` beside this file holds what
`benchmarks/attention_kernels.py --tune` measured fastest on a GPU for a model's attention shape; other GPUs
and shapes run the defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pallas_kernels.split_rows import PROGRAMS_PER_CORE

TUNED_FILE = Path(__file__).with_name("tuned.json")


@dataclass(frozen=True)
class DecodeLaunch:
    pages_per_block: int | None = None  # K/V pages a block loads (None: 64 keys)
    num_warps: int = 4
    num_stages: int = 2  # Triton's software pipelining of the K/V loads
    programs_per_core: int = PROGRAMS_PER_CORE  # split-KV: decode programs per SM to aim for (decode_splits)


@dataclass(frozen=True)
class PrefillLaunch:
    block_q: int = 16  # query tokens a row holds (all query heads of a KV head share each K/V block)
    pages_per_block: int | None = None
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class AttentionShape:
    """What the settings are measured for: a GPU (its device kind) and a model's K/V pages."""

    device_kind: str
    dtype: str
    head_dim: int
    group: int  # query heads per KV head
    page_size: int


def tuned_launches(shape: AttentionShape) -> tuple[DecodeLaunch, PrefillLaunch]:
    """The measured settings for this GPU and shape, else the defaults."""
    entry = _tuned().get(shape)
    return entry if entry is not None else (DecodeLaunch(), PrefillLaunch())


@functools.cache
def _tuned() -> dict[AttentionShape, tuple[DecodeLaunch, PrefillLaunch]]:
    entries = json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else []
    return {
        AttentionShape(**entry["shape"]): (DecodeLaunch(**entry["decode"]), PrefillLaunch(**entry["prefill"]))
        for entry in entries
    }


def tuned_entry(shape: AttentionShape, decode: DecodeLaunch, prefill: PrefillLaunch, **measured) -> dict:
    """A tuned.json entry (the measurements are kept beside it, for the record)."""
    return dict(shape=dataclasses.asdict(shape), decode=dataclasses.asdict(decode),
                prefill=dataclasses.asdict(prefill), measured=measured)  # fmt: skip
