"""Embedding throughput: jserve's LLM.embed against sentence-transformers on the same machine, the same weights
and the same texts.

The model is SmolLM2-135M-Instruct (the default model's weights, dequantized to float32) saved as a
sentence-transformers embedder: Hugging Face safetensors, last-token pooling, normalized. (Its tokenizer has a
chat template, so sentence-transformers 6 saves it with a message modality: both sides send each text through
the template as a user message, ~26 tokens more.) The inputs are --inputs texts of 32 to 512 tokens
(uniform), made of common words. Each side embeds them all, --repeats
times, alternating; the medians are printed with their ratio. sentence-transformers runs torch on the CPU with
its defaults (batches of 32 sorted by length); jserve its engine defaults unless --max-num-batched-tokens says,
without the prefix cache (which would serve a repeat's inputs from the one before).

    python benchmarks/embeddings.py --inputs 256 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("the of and to in is was that for on with as by at from his her they this which are be or an have had "
         "not but all were when we there can an your one more if will about up out them time only other new some "
         "could these two may first then do any like my now over such our man me even most made after also did "
         "many before must through back years where much way well down should because each just those people how "
         "too little state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against go came right used "
         "take three").split()  # fmt: skip


def save_embedder(folder: Path) -> None:
    """The default model's weights and tokenizer as a Hugging Face folder with sentence-transformers modules."""
    import transformers
    from safetensors.numpy import save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    from jserve import LLM

    llm = LLM(dtype="float32", max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    c = llm.engine.model.config
    weights = {name: np.ascontiguousarray(array) for name, array in llm.get_weights().items()}
    save_file(weights, str(folder / "model.safetensors"))
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )  # fmt: skip
    config.save_pretrained(folder)
    llm.tokenizer.save(folder)
    del llm
    transformer = modules.Transformer(str(folder))
    transformer.tokenizer.pad_token = transformer.tokenizer.eos_token
    pooling = modules.Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[transformer, pooling, modules.Normalize()]).save(str(folder))


def make_texts(tokenizer, count: int, seed: int = 0) -> list[str]:
    """`count` texts of 32 to 512 tokens each (uniform), by this tokenizer's count."""
    rng = np.random.default_rng(seed)
    texts = []
    for target in rng.integers(32, 513, count):
        words = list(rng.choice(WORDS, int(target)))
        while len(tokenizer.encode(" ".join(words))) > target:
            words.pop()
        texts.append(" ".join(words))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="jserve's token budget per step")
    parser.add_argument("--folder", help="where the embedder is saved (default: a temporary folder)")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from jserve import LLM

    folder = Path(args.folder or tempfile.mkdtemp(prefix="jserve-embedder-"))
    if not (folder / "modules.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        save_embedder(folder)
    # (no prefix cache: a repeat must not find the last one's inputs cached)
    llm = LLM(str(folder), max_model_len=1024, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False)  # fmt: skip
    texts = make_texts(llm.tokenizer, args.inputs)
    reference = SentenceTransformer(str(folder), device="cpu")
    print(f"{len(texts)} inputs; torch threads {torch.get_num_threads()}; jserve token budget "
          f"{llm.engine.config.max_num_batched_tokens}")  # fmt: skip
    seconds = {"jserve": [], "sentence-transformers": []}
    for repeat in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.embed(texts, use_tqdm=False)
        seconds["jserve"].append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = reference.encode(texts, convert_to_numpy=True)
        seconds["sentence-transformers"].append(time.perf_counter() - start)
        ours = np.array([o.outputs.embedding for o in outputs])
        agree = float(((ours * theirs).sum(1)).min())
        print(f"repeat {repeat}: jserve {seconds['jserve'][-1]:.2f} s, sentence-transformers "
              f"{seconds['sentence-transformers'][-1]:.2f} s; lowest cosine between the two {agree:.6f}")  # fmt: skip
    # The tokens each side gives its model (the texts in the checkpoint's chat template): the same, or the
    # rates would not compare.
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    reference_tokens = int(reference.preprocess(texts)["attention_mask"].sum())
    print(f"tokens: {tokens} ({tokens / len(texts):.0f} per input); sentence-transformers' model reads "
          f"{reference_tokens}")  # fmt: skip
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    print("\n| | inputs/s | tokens/s |\n| --- | --- | --- |")
    for name, s in medians.items():
        print(f"| {name} | {len(texts) / s:.1f} | {tokens / s:.0f} |")
    print(f"\njserve / sentence-transformers: {medians['sentence-transformers'] / medians['jserve']:.2f}x (medians "
          f"of {args.repeats})")  # fmt: skip
    print(json.dumps({"seconds": seconds, "tokens": tokens, "reference_tokens": reference_tokens}))


if __name__ == "__main__":
    main()
