"""How an engine serves LoRA adapters, and how a request names one (vLLM's LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass

from jserve.setting import json_object


@dataclass(frozen=True)
class LoRARequest:
    """Run a request with the adapter `lora_name` (vLLM's fields): loaded from `lora_path` (a PEFT folder or
    a hub id) the first time, found by name after that. `lora_int_id` is kept for vLLM's API."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters on the device at once (slots every step computes)
    max_lora_rank: int = 16  # every slot's rank (smaller adapters are padded with zeros)
    max_cpu_loras: int | None = None  # adapters requests brought kept in host memory; default: max_loras
    download_dir: str | None = None  # where hub adapters are looked up and downloaded (default: the HF cache)

    def __post_init__(self):
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras {self.max_loras} and max_lora_rank {self.max_lora_rank} must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} must be >= 1")

    @property
    def host_capacity(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


def parse_lora_modules(modules: list[str] | str) -> dict[str, str]:
    """--lora-modules as {name: path}: each `name=path`, or vLLM's JSON {"name": ..., "path": ...}."""
    if isinstance(modules, str):
        modules = [modules]
    named = {}
    for module in modules:
        if module.lstrip().startswith("{"):
            entry = json_object(module, "--lora-modules")
            name, path = entry.get("name"), entry.get("path")
        else:
            name, _, path = module.partition("=")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f"--lora-modules {module!r}: give each adapter as name=path")
        if name in named:
            raise ValueError(f"--lora-modules names {name!r} twice")
        named[name] = path
    return named
