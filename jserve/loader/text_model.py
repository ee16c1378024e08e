"""The language model's tensors of a checkpoint that may also hold a vision tower (Gemma 3's image-and-text
checkpoints): those under `language_model` renamed to the plain text model's names, the vision tower and
its projector left out."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import numpy as np

log = logging.getLogger("jserve")

# Where checkpoints put the text model: as published (language_model.model.*) and as transformers 5 saves it.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_tensors(tensors: Iterable[tuple[str, np.ndarray]], source: str) -> Iterator[tuple[str, np.ndarray]]:
    skipped = 0
    for name, array in tensors:
        if name.startswith(VISION_PREFIXES):
            skipped += 1
            continue
        for prefix, plain in TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = plain + name.removeprefix(prefix)
                break
        yield name, array
    if skipped:
        log.info("%s: %d vision tensors not loaded (jserve serves the text model)", source, skipped)
