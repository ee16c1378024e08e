"""Every supported family, loaded from a tiny transformers checkpoint, computes the logits transformers does.

(Greedy decoding through the engine is compared with transformers' generate in test_engine.py.)
"""

import numpy as np
import pytest

from jserve.loader import load_model
from jserve.loader.hf_config import MODEL_TYPES
from jserve.models import fused

from tiny_models import (
    LONGROPE,
    VARIANTS,
    VOCAB_SIZE,
    jserve_prompt_logits,
    reference_logits,
    save_tiny_checkpoint,
)

LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_checkpoint(folder, family, **overrides)
    return reference, load_model(folder, dtype="float32")


def test_family_is_detected(checkpoint):
    reference, model = checkpoint
    model_type = reference.config.model_type
    assert model.config.family == MODEL_TYPES.get(model_type, model_type)  # gemma3_text: gemma3
    assert model.config.num_kv_heads == reference.config.num_key_value_heads


def test_full_sequence_logits_match_transformers(checkpoint):
    reference, model = checkpoint
    ids = np.random.default_rng(1).integers(0, VOCAB_SIZE, 45).tolist()  # ends mid-page (page size 16)
    ours, theirs = jserve_prompt_logits(model, ids), reference_logits(reference, ids)
    np.testing.assert_allclose(ours, theirs, atol=LOGITS_ATOL, rtol=0)


def test_experts_weighted_without_renormalizing_match_transformers(tmp_path):
    """Qwen3-MoE with norm_topk_prob false (Qwen2-MoE's way): the top k's softmax weights as they are."""
    family, overrides = VARIANTS["qwen3_moe"]
    reference = save_tiny_checkpoint(tmp_path, family, **overrides | {"norm_topk_prob": False})
    model = load_model(tmp_path, dtype="float32")
    assert not model.config.norm_topk_prob
    ids = np.random.default_rng(3).integers(0, VOCAB_SIZE, 30).tolist()
    np.testing.assert_allclose(jserve_prompt_logits(model, ids), reference_logits(reference, ids), atol=LOGITS_ATOL,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("max_model_len, length", [(None, 45), (32, 20)])
def test_longrope_factors_follow_the_served_context(tmp_path, max_model_len, length):
    """Phi-3's longrope trained for 32 positions and extended to 256: serving past 32 uses the long factors
    (transformers uses them for a pass longer than 32), serving within 32 the short ones."""
    reference = save_tiny_checkpoint(tmp_path, "phi3", original_max_position_embeddings=32,
                                     rope_parameters=LONGROPE | {"original_max_position_embeddings": 32})  # fmt: skip
    model = load_model(tmp_path, dtype="float32", max_model_len=max_model_len)
    assert model.config.rope_scaling.long == (max_model_len is None)
    assert model.config.rope_scaling.attention_factor > 1  # sqrt(1 + ln(256 / 32) / ln(32))
    ids = np.random.default_rng(2).integers(0, VOCAB_SIZE, length).tolist()
    np.testing.assert_allclose(jserve_prompt_logits(model, ids), reference_logits(reference, ids), atol=LOGITS_ATOL,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("shards", [1, 2])
def test_fused_rows_go_shard_by_shard_and_split_back(shards):
    """fused.fuse stacks q/k/v so each device's block of rows holds its share of every piece; fused.split
    takes a weight's rows (axis 0) or a matmul's outputs (axis -1) back apart."""
    q, k, v = (np.arange(width * 3).reshape(width, 3) + 100 * i for i, width in enumerate((4, 2, 2)))
    rows = fused.fuse([q, k, v], shards)
    block = len(rows) // shards
    for device in range(shards):
        expected = [piece[device * len(piece) // shards : (device + 1) * len(piece) // shards] for piece in (q, k, v)]
        np.testing.assert_array_equal(rows[device * block : (device + 1) * block], np.concatenate(expected))
    for got, piece in zip(fused.split(rows, (4, 2, 2), shards, axis=0), (q, k, v), strict=True):
        np.testing.assert_array_equal(got, piece)
    for got, piece in zip(fused.split(rows.T, (4, 2, 2), shards, axis=-1), (q, k, v), strict=True):
        np.testing.assert_array_equal(got, piece.T)
