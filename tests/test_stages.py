"""A step's optional stages decided by the host (as on GPUs) or by the device (CPU, TPU): the same tokens and
logprobs either way, for every mix of rows (jserve/engine/stages.py).

Where the host decides, a stage runs for every row when some row needs it, so each stage must leave the rows
that did not ask for it as skipping it would; and a stage the host leaves out must be one no row needs.
"""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_rows import SamplingRow, build_sampling_batch
from test_structured import constrained, start_deferred_sampling

from jserve import SamplingParams
from jserve.engine import runner as runner_module
from jserve.engine.prompt_logprobs import score_positions
from jserve.engine.sampler import full_bitmask, init_penalty_state, sample
from jserve.engine.stages import DEVICE_DECIDES, Gate, StepStages, penalised_rows, step_stages
from jserve.engine.step_executables import cost, covers

from test_engine import prompts, tiny_llm, token_ids
from tiny_models import assert_engine_idle

VOCAB, SLOTS = 96, 4
ALL_RUN = StepStages(*[Gate.RUN] * len(dataclasses.fields(StepStages)))
PLAIN = StepStages(*[Gate.SKIP] * len(dataclasses.fields(StepStages)))
GREEDY = SamplingParams(temperature=0)
BATCHES = {
    "greedy": [GREEDY, GREEDY],
    "greedy with a bias": [GREEDY, SamplingParams(temperature=0, logit_bias={5: 40.0})],
    "greedy with penalties": [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5), GREEDY],
    "greedy and a grammar": [GREEDY, "constrained"],
    "temperature": [SamplingParams(temperature=0.8), GREEDY],
    "top-k and top-p": [SamplingParams(top_k=7), SamplingParams(top_p=0.8, temperature=1.2), GREEDY],
    "logprobs": [SamplingParams(temperature=0, logprobs=3), GREEDY],
    "everything": [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, presence_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0, logit_bias={1: -100.0}),
        "constrained",
    ],
}


def batch_of(rows: list) -> tuple:
    """A SamplingBatch (numpy) of the rows and two padding rows; "constrained": a greedy row allowed even ids."""
    num_seqs = len(rows) + 2
    bitmask = full_bitmask(num_seqs, VOCAB)
    sampling_rows = []
    for i, row in enumerate(rows):
        constrained = row == "constrained"
        if constrained:
            bitmask[i] = np.packbits(np.arange(bitmask.shape[1] * 32) % 2 == 0, bitorder="little").view(np.int32)
        params = GREEDY if constrained else row
        sampling_rows.append(SamplingRow(params, seed=i, step=3, slot=i % SLOTS, constrained=constrained))
    return build_sampling_batch(sampling_rows, num_seqs, bitmask)


def host_stages(batch, targets: np.ndarray, deferred: bool = False) -> StepStages:
    """step_stages of a step of `batch`'s rows, a token each (targets: each token's prompt target): its
    penalised rows' tokens recorded as a step records them; `deferred`: its first row's grammar mask comes
    after launch."""
    rows = batch.temperature.shape[0]
    recorded = np.zeros(len(targets), bool)
    recorded[:rows] = penalised_rows(batch)
    penalties = SimpleNamespace(recorded=recorded, reset=np.zeros(rows, bool))
    step = SimpleNamespace(sampling=batch, prompt_targets=targets, penalties=penalties,
                           deferred=np.arange(rows) == (0 if deferred else -1))  # fmt: skip
    return step_stages(step, VOCAB)


def penalty_state(rng):
    state = init_penalty_state(SLOTS, VOCAB)
    mask, counts = rng.random((SLOTS, VOCAB)) < 0.3, rng.integers(0, 3, (SLOTS, VOCAB)).astype(np.int32)
    return dataclasses.replace(state, prompt_mask=jnp.asarray(mask), output_counts=jnp.asarray(counts))


def sampled(logits, batch, state, stages, argmax_platform: str, monkeypatch):
    """The samples as numpy arrays, the argmax as compiled for `argmax_platform` (cpu: in blocks, else whole rows)."""
    with monkeypatch.context() as patch:
        patch.setattr(jax.lax, "platform_dependent", lambda *a, **branches: branches[argmax_platform](*a))
        out = jax.jit(sample, static_argnums=3)(logits, batch, state, stages)
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("name", BATCHES)
def test_samples_are_the_same_whoever_decides_the_stages(name, monkeypatch):
    rng = np.random.default_rng(len(name))
    batch, state = batch_of(BATCHES[name]), penalty_state(rng)
    logits = rng.normal(scale=3.0, size=(batch.temperature.shape[0], VOCAB)).astype(np.float32)
    host = host_stages(batch, np.full(8, -1, np.int32))
    expected = sampled(logits, batch, state, DEVICE_DECIDES, "cpu", monkeypatch)
    wants = batch.wants_top_logprobs
    for stages in (host, ALL_RUN):
        for platform in ("cpu", "default"):
            out = sampled(logits, batch, state, stages, platform, monkeypatch)
            np.testing.assert_array_equal(out.token_ids, expected.token_ids, err_msg=f"{stages}, argmax {platform}")
            # logprobs are read for the rows that asked (the others' are whatever the stage computed)
            np.testing.assert_array_equal(out.logprobs[wants], expected.logprobs[wants])
            np.testing.assert_array_equal(out.top_ids[wants], expected.top_ids[wants])
    assert not (set(dataclasses.astuple(host)) - {Gate.RUN, Gate.SKIP})


def test_the_host_runs_only_the_stages_its_rows_need():
    no_targets, targets = np.full(8, -1, np.int32), np.array([-1, 7, 3, -1, -1, -1, -1, -1], np.int32)
    assert host_stages(batch_of(BATCHES["greedy"]), no_targets) == PLAIN
    assert str(host_stages(batch_of(BATCHES["greedy"]), targets)) == "stages prompt_scores"
    assert str(host_stages(batch_of(BATCHES["greedy and a grammar"]), no_targets)) == "stages adjust"
    assert str(host_stages(batch_of(BATCHES["temperature"]), no_targets)) == "stages draw"
    # penalties read the token history the step records; a deferred grammar row's logits are kept
    assert str(host_stages(batch_of(BATCHES["greedy with penalties"]), no_targets)) == "stages adjust, carry"
    assert str(host_stages(batch_of(BATCHES["greedy"]), no_targets, deferred=True)) == "stages carry"
    everything = host_stages(batch_of(BATCHES["everything"]), targets)
    assert everything == ALL_RUN
    # top-k at the whole vocabulary, and top-p of 1, filter nothing; a greedy row's filters do not apply
    unfiltered = [SamplingParams(top_k=VOCAB), SamplingParams(top_p=1.0), SamplingParams(temperature=0, top_k=3)]
    assert str(host_stages(batch_of(unfiltered), no_targets)) == "stages draw"


def test_prompt_scores_are_the_same_whoever_decides():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(8, 16)).astype(np.float32))
    weights = jnp.asarray(rng.normal(size=(16, VOCAB)).astype(np.float32))
    targets = jnp.asarray(np.array([-1, 4, 90, -1, -1, 0, 17, -1], np.int32))
    scored = targets >= 0

    def head(h):
        return h @ weights

    expected = score_positions(head, hidden, targets, Gate.WHEN_NEEDED)
    out = score_positions(head, hidden, targets, Gate.RUN)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[scored], np.asarray(b)[scored])


def test_a_step_runs_on_the_cheapest_executable_that_runs_what_it_needs():
    draw = dataclasses.replace(PLAIN, draw=Gate.RUN)
    draw_filters = dataclasses.replace(draw, filters=Gate.RUN)
    assert covers(draw_filters, draw) and covers(draw, PLAIN) and covers(DEVICE_DECIDES, ALL_RUN)
    assert not covers(draw, draw_filters) and not covers(PLAIN, draw)
    assert min([DEVICE_DECIDES, draw_filters, ALL_RUN], key=cost) == draw_filters


def requests():
    """A mixed workload touching every stage: its prompts and each prompt's options."""
    options = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6),
        SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=6),
        SamplingParams(temperature=0, repetition_penalty=1.4, logit_bias={7: 3.0}, max_tokens=6),
        SamplingParams(temperature=0, logprobs=2, max_tokens=6),
        SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=2),
    ]
    return prompts(len(options), seed=11), options


def test_an_engine_whose_host_decides_the_stages_serves_the_same_tokens(
    llm_outputs, tiny_llama_checkpoint, monkeypatch
):
    """The GPU's way on this CPU: warm-up compiles the plain step and the one whose device decides; steps
    needing other stages run on that one while their own combination compiles in the background, then on
    that: the same outputs either way, and no compilation on the engine's thread (the debug checks would
    fail)."""
    monkeypatch.setattr(runner_module, "host_decides", lambda platform: True)
    engine = tiny_llm(tiny_llama_checkpoint[0])
    steps = engine.engine.runner.steps
    buckets = engine.engine.config.token_buckets
    assert set(steps.compiled) == {(b, s) for b in buckets for s in (PLAIN, DEVICE_DECIDES)}
    batch, options = requests()
    for _ in range(2):  # (the second time on the combinations compiled in the background during the first)
        outputs = engine.generate(batch, options, use_tqdm=False)
        for out, expected in zip(outputs, llm_outputs, strict=True):
            assert out.outputs[0].token_ids == expected.outputs[0].token_ids
            assert out.outputs[0].logprobs == expected.outputs[0].logprobs
            assert out.prompt_logprobs == expected.prompt_logprobs
        steps.finish()
    combinations = {stages for _, stages in steps.compiled} - {DEVICE_DECIDES, PLAIN}
    assert {"draw", "filters", "adjust", "logprobs", "prompt_scores", "carry"} <= {
        name for stages in combinations for name in str(stages).removeprefix("stages ").split(", ")
    }, combinations
    assert_engine_idle(engine)


def test_deferred_grammar_rows_keep_their_logits_where_the_host_decides(tiny_llama_checkpoint, monkeypatch):
    """Greedy grammar rows sampled after launch: their step runs no `adjust` stage (their masks come later)
    but must keep their logits for the deferred draw (the `carry` stage). The tokens are those of steps that
    wait for their predecessor and sample the rows themselves."""
    monkeypatch.setattr(runner_module, "host_decides", lambda platform: True)
    engine = tiny_llm(tiny_llama_checkpoint[0])
    runner = engine.engine.runner
    start_deferred_sampling(runner)
    batch = prompts(3, seed=31)
    params = [constrained(regex="[a-z ]{5,30}[.]"), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              constrained(choice=["one", "two", "three"])]  # fmt: skip
    drawn, sample_deferred = [], runner.sample_deferred
    monkeypatch.setattr(runner, "sample_deferred", lambda *args: drawn.append(len(args[1])) or sample_deferred(*args))
    engine.generate(batch, params, use_tqdm=False)
    runner.steps.finish()  # (now on the executables of their own stages)
    drawn.clear()
    after_launch = token_ids(engine.generate(batch, params, use_tqdm=False))
    assert drawn  # grammar rows were drawn after launch
    assert any(str(stages) == "stages carry" for _, stages in runner.steps.compiled)
    monkeypatch.setattr(type(runner), "defers_grammar", property(lambda self: False))
    assert token_ids(engine.generate(batch, params, use_tqdm=False)) == after_launch
    assert_engine_idle(engine)


@pytest.fixture
def llm_outputs(tiny_llama_checkpoint):
    """The workload's outputs from an engine whose device decides the stages (this CPU's way)."""
    engine = tiny_llm(tiny_llama_checkpoint[0])
    batch, options = requests()
    return engine.generate(batch, options, use_tqdm=False)
