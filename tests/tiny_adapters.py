"""Random LoRA adapters saved with PEFT on the tiny checkpoints (tiny_models.py), for tests that compare
jserve's adapters against transformers + PEFT."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's checkpoint fuses its projections


def save_tiny_adapter(
    folder: Path,
    base: transformers.PreTrainedModel,
    seed: int,
    rank: int = 8,
    modules: list[str] | None = None,
    **options,
):
    """A LoRA adapter of `base` with random A and B (PEFT starts B at zero, which would change nothing), saved
    into `folder`; returns the PEFT model (base + adapter) to compare with. `options`: LoraConfig's."""
    import peft

    if modules is None:
        modules = PHI3_MODULES if base.config.model_type == "phi3" else ALL_MODULES
    config = peft.LoraConfig(r=rank, lora_alpha=options.pop("lora_alpha", 2 * rank), target_modules=modules,
                             init_lora_weights=False, **options)  # fmt: skip
    torch.manual_seed(seed)
    model = peft.get_peft_model(_copy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.eval()
    model.save_pretrained(folder)
    return model


def _copy(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A copy of the base: PEFT wraps the modules of the model it is given in place."""
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    return clone.float().eval()
