"""Log-likelihood parity with Hugging Face: lm-evaluation-harness on a local multiple-choice task, twice.

Runs lm-eval's `jserve_mc` task (benchmarks/eval_task/: 52 plain-English questions, 4 choices each) once with
the `hf` backend (transformers, float32) and once with `local-completions` against a jserve server, then
compares every (question, choice) log-likelihood. Prints max |Δ loglikelihood| and both accuracies; exits 1
if max Δ > --tol (1e-3) or the accuracies differ. Everything is local: the hub is never contacted.

local-completions scores each choice with one POST /v1/completions per batch: `prompt` is a list of token-id
lists (context + choice, tokenized here with FOLDER's tokenizer), `echo: true, logprobs: 1, max_tokens: 1,
temperature: 0, seed: 1234`; it reads choices[i].logprobs.token_logprobs[ctxlen:-1] (the last entry, the one
generated token, is dropped) and top_logprobs[ctxlen:-1] (for is_greedy), with choices ordered by `index`.

Needs lm-eval in its own venv (torch CPU from the wheel folder first, so pip does not pull CUDA torch):

    python3 -m venv /tmp/v-eval && /tmp/v-eval/bin/pip install torch==2.13.0 "lm-eval[hf,api]==0.4.13"

Then, with FOLDER a Hugging Face model folder (config.json, safetensors, tokenizer files):

    jserve serve FOLDER --dtype float32 --served-model-name eval-model --port 8000 &
    /tmp/v-eval/bin/python benchmarks/eval_parity.py FOLDER --base-url http://127.0.0.1:8000/v1/completions \\
        --model-name eval-model

`--hf-only` runs just the hf side (no server needed). local-completions sends `Authorization: Bearer
$OPENAI_API_KEY` (empty if unset): for a server started with --api-key KEY, set OPENAI_API_KEY=KEY.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # (tests import this module and must not change the process's environment)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")  # before lm_eval imports datasets / transformers: no hub, ever

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TASK = "jserve_mc"
TASK_DIR = Path(__file__).resolve().parent / "eval_task"


def run_lm_eval(model: str, model_args: dict, batch_size: int, limit: int | None) -> tuple[dict, list[list[float]]]:
    """One lm-eval run of TASK: (metrics, per-item list of the choices' log-likelihoods, in doc_id order)."""
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        batch_size=batch_size,
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,  # no stderr resampling: we compare point values
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    # multiple_choice: one (loglikelihood, is_greedy) per choice, in the task's choice order
    lls = [[float(ll) for ll, _greedy in s["filtered_resps"]] for s in samples]
    metrics = {k.split(",")[0]: v for k, v in out["results"][TASK].items() if k.split(",")[0] in ("acc", "acc_norm")}
    print(f"{model}: {len(lls)} items, {sum(map(len, lls))} choices, {time.perf_counter() - start:.1f} s, "
          + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))  # fmt: skip
    return metrics, lls


def hf_model_args(folder: str, device: str | None = "cpu") -> dict:
    # add_bos_token=True on both sides: each tokenizes with the tokenizer's own special tokens (BOS where it
    # adds one), so both score the same token ids (local-completions would otherwise drop the BOS).
    return {"pretrained": folder, "dtype": "float32", "add_bos_token": True} | ({"device": device} if device else {})


def api_model_args(folder: str, base_url: str, model_name: str) -> dict:
    return {
        "model": model_name,
        "base_url": base_url,
        "tokenizer_backend": "huggingface",
        "tokenizer": folder,
        "add_bos_token": True,
        "tokenized_requests": True,  # prompts go as token ids: the server scores exactly what hf scored
        "num_concurrent": 1,
        "max_retries": 1,  # a 4xx is a bug to see, not to retry
    }


def compare(hf: list[list[float]], api: list[list[float]]) -> tuple[float, tuple[int, int]]:
    """Max |Δ| over all (item, choice) pairs and where it is."""
    assert len(hf) == len(api) and all(len(a) == len(b) for a, b in zip(hf, api, strict=True)), "item/choice mismatch"
    deltas = [(abs(a - b), (i, c)) for i, (ra, rb) in enumerate(zip(hf, api, strict=True))
              for c, (a, b) in enumerate(zip(ra, rb, strict=True))]  # fmt: skip
    return max(deltas)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="local HF model folder (float32 weights); also the tokenizer for both runs")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1/completions")
    parser.add_argument("--model-name", default=None, help="the server's served model name (default: FOLDER)")
    parser.add_argument("--batch-size", type=int, default=8, help="hf forward batch; prompts per API request")
    parser.add_argument("--limit", type=int, default=None, help="only the first N items")
    parser.add_argument("--device", default="cpu", help="hf device (cpu, or cuda)")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest |Δ loglikelihood| allowed")
    parser.add_argument("--hf-only", action="store_true", help="run only the hf side")
    args = parser.parse_args()

    folder = str(Path(args.folder).resolve())
    hf_metrics, hf_lls = run_lm_eval("hf", hf_model_args(folder, args.device), args.batch_size, args.limit)
    if args.hf_only:
        lo, hi = min(min(r) for r in hf_lls), max(max(r) for r in hf_lls)
        print(f"hf loglikelihoods in [{lo:.4f}, {hi:.4f}]; item 0: {[round(x, 4) for x in hf_lls[0]]}")
        return 0

    api_args = api_model_args(folder, args.base_url, args.model_name or args.folder)
    api_metrics, api_lls = run_lm_eval("local-completions", api_args, args.batch_size, args.limit)

    delta, (item, choice) = compare(hf_lls, api_lls)
    print(f"max |Δ loglikelihood| = {delta:.3g} (item {item}, choice {choice}: "
          f"hf {hf_lls[item][choice]:.6f}, server {api_lls[item][choice]:.6f}); tolerance {args.tol:g}")  # fmt: skip
    for name in ("acc", "acc_norm"):
        print(f"{name}: hf {hf_metrics[name]:.4f}, server {api_metrics[name]:.4f}")
    ok = delta <= args.tol and hf_metrics["acc"] == api_metrics["acc"]
    print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
