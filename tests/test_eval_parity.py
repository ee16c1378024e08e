"""lm-evaluation-harness against jserve: its `local-completions` model (echo + logprobs over token-id prompts,
what every log-likelihood benchmark sends) scores a local multiple-choice task as its `hf` model does on the
same float32 weights. The task and the comparison are benchmarks/eval_parity.py's."""

import importlib.util
import shutil
from pathlib import Path

from tokenizers import Tokenizer, processors

from jserve.server import ServerSettings

from server_utils import running_server
from tiny_models import tiny_engine_args

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "eval_parity.py"
SERVED = "eval-model"
ITEMS = 24  # of the task's 52: each costs both backends four forward passes


def load_script():
    spec = importlib.util.spec_from_file_location("eval_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_bos_tokenizer(checkpoint: Path, folder: Path) -> str:
    """A copy of the checkpoint whose tokenizer adds BOS itself, as real checkpoints' do: lm-eval's hf model
    prepends one by hand where a tokenizer does not, while local-completions relies on the tokenizer."""
    shutil.copytree(checkpoint, folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_lm_eval_local_completions_agrees_with_hf(tiny_llama_checkpoint, tmp_path):
    parity = load_script()
    folder = with_bos_tokenizer(tiny_llama_checkpoint[0], tmp_path / "model")
    hf_metrics, hf = parity.run_lm_eval("hf", parity.hf_model_args(folder), 8, ITEMS)
    with running_server(tiny_engine_args(folder), ServerSettings(SERVED)) as server:
        api_args = parity.api_model_args(folder, f"{server.base_url}/v1/completions", SERVED)
        api_metrics, api = parity.run_lm_eval("local-completions", api_args, 8, ITEMS)
    delta, where = parity.compare(hf, api)
    assert len(api) == ITEMS and delta <= 1e-3, (delta, where)
    assert api_metrics["acc"] == hf_metrics["acc"] and api_metrics["acc_norm"] == hf_metrics["acc_norm"]
