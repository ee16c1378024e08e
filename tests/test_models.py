"""Every supported family, loaded from a tiny transformers checkpoint, computes what transformers computes."""

import numpy as np
import pytest

from jserve.greedy import greedy_generate, prompt_logits
from jserve.loader import load_model

from tiny_models import VARIANTS, VOCAB_SIZE, reference_greedy, reference_logits, save_tiny_checkpoint

LOGITS_ATOL = 1e-4
GREEDY_TOKENS = 32


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
    ours, theirs = prompt_logits(model, ids), reference_logits(reference, ids)
    np.testing.assert_allclose(ours, theirs, atol=LOGITS_ATOL, rtol=0)


def test_greedy_tokens_match_transformers(checkpoint):
    reference, model = checkpoint
    prompt = np.random.default_rng(2).integers(0, VOCAB_SIZE, 20).tolist()
    expected = reference_greedy(reference, prompt, GREEDY_TOKENS)
    # Decisive steps only: with logits within LOGITS_ATOL of the reference, a top-2 gap above twice that
    # cannot flip the argmax, so a mismatch below is a real bug, not float noise.
    logits = reference_logits(reference, prompt + expected)[len(prompt) - 1 : -1]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * LOGITS_ATOL
    assert greedy_generate(model, prompt, GREEDY_TOKENS, stop_ids=()) == expected
