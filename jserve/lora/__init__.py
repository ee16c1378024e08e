"""Serving many LoRA adapters of one base model: PEFT folders read onto the projections (peft.py), the names
an engine knows (registry.py) and the device slots its steps read (slots.py); the math runs in the model
(models/low_rank.py)."""

from jserve.lora.config import LoRAConfig, LoRARequest, parse_lora_modules
from jserve.lora.peft import AdapterError, read_adapter
from jserve.lora.registry import AdapterRegistry, ServedAdapter
from jserve.lora.slots import AdapterSlots, SlotLayout

__all__ = ["AdapterError", "AdapterRegistry", "AdapterSlots", "LoRAConfig", "LoRARequest", "ServedAdapter",
           "SlotLayout", "parse_lora_modules", "read_adapter"]  # fmt: skip
