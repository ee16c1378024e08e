"""Every supported family, loaded from a tiny transformers checkpoint, computes the logits transformers does.

(Greedy decoding through the engine is compared with transformers' generate in test_engine.py.)
"""

import numpy as np
import pytest

from jserve.loader import load_model

from tiny_models import VARIANTS, VOCAB_SIZE, jserve_prompt_logits, reference_logits, save_tiny_checkpoint

LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_checkpoint(folder, family, **overrides)
    return reference, load_model(folder, dtype="float32")


def test_family_is_detected(checkpoint):
    reference, model = checkpoint
    assert model.config.family == reference.config.model_type
    assert model.config.num_kv_heads == reference.config.num_key_value_heads


def test_full_sequence_logits_match_transformers(checkpoint):
    reference, model = checkpoint
    ids = np.random.default_rng(1).integers(0, VOCAB_SIZE, 45).tolist()  # ends mid-page (page size 16)
    ours, theirs = jserve_prompt_logits(model, ids), reference_logits(reference, ids)
    np.testing.assert_allclose(ours, theirs, atol=LOGITS_ATOL, rtol=0)
