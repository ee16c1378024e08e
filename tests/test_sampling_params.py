"""SamplingParams: every validation rule, the normalisations, and the vocabulary check."""

import dataclasses

import numpy as np
import pytest

from jserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

# (field values, words the ValueError must contain)
INVALID = [
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"n": 1.5}, "n must be an integer"),
    ({"n": True}, "n must be an integer"),
    ({"temperature": -1}, "temperature must be >= 0, got -1"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": None}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.01}, "top_p must be in (0, 1]"),
    ({"top_p": -0.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be >= -1, got -2"),
    ({"top_k": 4.0}, "top_k must be an integer"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3"),
    ({"frequency_penalty": -2.01}, "frequency_penalty must be in [-2, 2]"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": "42"}, "seed must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": "16"}, "max_tokens must be an integer"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 17}, "min_tokens must be <= max_tokens (16), got 17"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be <= max_tokens (4), got 5"),
    ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs must be in [0, 20], got 21"),
    ({"logprobs": True}, "logprobs must be an integer"),
    ({"stop": ""}, "stop strings must be non-empty"),
    ({"stop": ["a", ""]}, "stop strings must be non-empty"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"stop": ["a", 5]}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0, got -1"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids must be an integer"),
    ({"stop_token_ids": 2}, "stop_token_ids must be a list of token ids"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5] must be in [-100, 100], got 100.5"),
    ({"logit_bias": {5: -101}}, "logit_bias[5] must be in [-100, 100]"),
    ({"logit_bias": {5: float("-inf")}}, "logit_bias[5] must be a finite number"),
    ({"logit_bias": {5: "big"}}, "logit_bias[5] must be a finite number"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias keys must be token ids >= 0, got -3"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias keys must be token ids >= 0"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias keys must be token ids >= 0"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias keys must be token ids >= 0"),
    (
        {"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)},
        "logit_bias must have at most 300 entries, got 301",
    ),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias must be a mapping"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens must be a bool"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_values_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


# Values on the edges of the allowed ranges.
VALID = [
    {"n": 1},
    {"temperature": 0},
    {"temperature": 1e-9},
    {"temperature": 5},
    {"top_p": 1},
    {"top_p": 1e-9},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"min_p": 0},
    {"min_p": 1},
    {"repetition_penalty": 1e-3},
    {"presence_penalty": -2, "frequency_penalty": 2},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"seed": -5},
    {"seed": 2**40},
    {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 1, "min_tokens": 1},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS), 100.0)},
    {"logit_bias": {0: -100}},
    {"stop": []},
    {"stop_token_ids": []},
    {"n": np.int64(2), "temperature": np.float32(0.5), "top_k": np.int32(3)},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[str(sorted(k))[:60] for k in VALID])
def test_values_on_the_edges_are_accepted_as_given(kwargs):
    params = SamplingParams(**kwargs)
    expected = {name: tuple(value) if isinstance(value, list) else value for name, value in kwargs.items()}
    if expected.get("top_k") == -1:
        expected["top_k"] = 0  # -1 and 0 both mean off (test_top_k_minus_one_means_off)
    assert {name: getattr(params, name) for name in kwargs} == expected


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.logprobs) == (1, 1.0, 1.0, 0, 0.0, 16, None)
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.seed) == ((), (), {}, None)
    assert not p.greedy


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_is_a_tuple_of_strings():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()


def test_stop_token_ids_are_a_tuple_of_ints():
    p = SamplingParams(stop_token_ids=[3, np.int64(7)])
    assert p.stop_token_ids == (3, 7)
    assert all(type(i) is int for i in p.stop_token_ids)


def test_logit_bias_keys_from_json_become_ints():
    p = SamplingParams(logit_bias={"50256": -100, 7: 2, "12": 0.5})
    assert p.logit_bias == {50256: -100.0, 7: 2.0, 12: 0.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())


def test_numbers_become_plain_python_types():
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_p=1, seed=np.uint32(9), logprobs=np.int8(3))
    assert (type(p.n), type(p.temperature), type(p.top_p), type(p.seed), type(p.logprobs)) == (
        int,
        float,
        float,
        int,
        int,
    )


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_frozen_and_replace_revalidates():
    p = SamplingParams(stop="x", logit_bias={"3": 1}, top_k=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    q = dataclasses.replace(p, seed=1)
    assert (q.stop, q.logit_bias, q.top_k) == (("x",), {3: 1.0}, 0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        dataclasses.replace(p, temperature=-0.5)


def test_validate_for_vocab():
    p = SamplingParams(stop_token_ids=[0, 99], logit_bias={99: 1.0})
    p.validate_for_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids token ids must be < vocab_size \(99\), got 99"):
        p.validate_for_vocab(99)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be < vocab_size \(50\), got 60"):
        SamplingParams(logit_bias={"60": -1}).validate_for_vocab(50)
    SamplingParams().validate_for_vocab(1)
