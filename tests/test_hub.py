"""Hub ids are downloaded with huggingface_hub from a fake hub on 127.0.0.1 (tests/fake_hub.py), cached, and
loaded from the cache with no network; every failure is one ModelLoadError that says what was tried."""

import importlib
import os
import re
import shutil
import subprocess
import sys

import huggingface_hub.constants
import numpy as np
import pytest

from jserve.cli import build_parser
from jserve.engine.args import EngineArgs
from jserve.errors import ModelLoadError
from jserve.loader import load_model
from jserve.loader.resolve import resolve_model
from jserve.lora import LoRARequest

from fake_hub import FakeHub, FakeRepo, folder_files
from test_engine import GREEDY, prompts, tiny_llm, token_ids
from tiny_adapters import save_tiny_adapter
from tiny_models import jserve_prompt_logits, save_tiny_checkpoint, tiny_kv_bytes, write_gguf

PROMPT = list(range(3, 40))
TOKEN = "hf_test_token"
# Files of acme/tiny-llama's main that jserve never reads: none may be requested, not even with HEAD.
EXTRAS = {
    "pytorch_model.bin": b"\0" * (2 << 20),
    "consolidated.safetensors": b"\0" * (1 << 20),  # Mistral-style repos hold a second checkpoint like this
    "original/consolidated.00.pth": b"\0" * (1 << 20),
    "chat_template.json": b"{}",  # jserve reads chat_template.jinja and tokenizer_config.json's template only
    "README.md": b"# tiny",
}
V1_EXTRAS = {"onnx/model.safetensors": b"\0" * 1024}  # v1 has no index: its weights are the top level's *.safetensors


def set_hf_env(monkeypatch, **env: str | None) -> None:
    """Set (None: unset) environment variables as if the process had started with them: huggingface_hub reads
    HF_ENDPOINT, HF_HUB_OFFLINE and the like once, into huggingface_hub.constants, when first imported."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    importlib.reload(huggingface_hub.constants)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama_checkpoint):
    """Local folders: main (the session's tiny Llama, saved again in 40 KB shards), v1 (other weights) and ggufs."""
    folder, torch_model = tiny_llama_checkpoint
    root = tmp_path_factory.mktemp("hub-checkpoints")
    torch_model.save_pretrained(root / "sharded", max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, root / "sharded")
    (root / "sharded" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    save_tiny_checkpoint(root / "v1", "llama", seed=1)
    (root / "gguf").mkdir()
    write_gguf(torch_model, folder, root / "gguf" / "tiny-f32.gguf")
    write_gguf(torch_model, folder, root / "gguf" / "tiny-f16.gguf", float_dtype=np.float16)
    save_tiny_adapter(root / "lora", torch_model, seed=1)
    return {
        "local": folder,
        "sharded": root / "sharded",
        "v1": root / "v1",
        "gguf": root / "gguf",
        "lora": root / "lora",
    }


@pytest.fixture(scope="module")
def repos(checkpoints):
    main = folder_files(checkpoints["sharded"])
    assert len([name for name in main if name.endswith(".safetensors")]) > 2 and "model.safetensors.index.json" in main
    v1 = folder_files(checkpoints["v1"])
    no_weights = {name: data for name, data in v1.items() if "safetensors" not in name}
    return {
        "acme/tiny-llama": FakeRepo({"main": {**main, **EXTRAS}, "v1": {**v1, **V1_EXTRAS}}),
        "acme/gated-llama": FakeRepo({"main": v1}, token=TOKEN),
        "acme/no-weights": FakeRepo({"main": {**no_weights, "pytorch_model.bin": b"\0" * 1024}}),
        "acme/tiny-llama-GGUF": FakeRepo({"main": {**folder_files(checkpoints["gguf"]), "README.md": b"# tiny"}}),
        "acme/tiny-llama-lora": FakeRepo({"main": {**folder_files(checkpoints["lora"]), "README.md": b"# lora"}}),
    }


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf-cache"


@pytest.fixture
def hub(repos, cache, tmp_path, monkeypatch):
    """The fake hub, running, with huggingface_hub pointed at it, an empty cache and no token."""
    server = FakeHub(repos).start()
    set_hf_env(monkeypatch, HF_ENDPOINT=server.url, HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"),
               HF_TOKEN=None, HUGGING_FACE_HUB_TOKEN=None, HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None)  # fmt: skip
    yield server
    server.stop()
    monkeypatch.undo()
    importlib.reload(huggingface_hub.constants)


def snapshot_of(cache, repo_id: str):
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"


def test_download_generates_what_the_local_folder_generates(hub, cache, checkpoints):
    batch = prompts(4, seed=3)
    downloaded = tiny_llm("acme/tiny-llama")
    assert downloaded.engine.model.source.path.parent == snapshot_of(cache, "acme/tiny-llama")
    expected = token_ids(tiny_llm(checkpoints["local"]).generate(batch, GREEDY, use_tqdm=False))
    assert token_ids(downloaded.generate(batch, GREEDY, use_tqdm=False)) == expected


@pytest.mark.parametrize("revision, extras", [("main", EXTRAS), ("v1", V1_EXTRAS)], ids=["index", "no-index"])
def test_only_the_files_jserve_reads_are_fetched(hub, repos, revision, extras):
    needed = sorted(name for name in repos["acme/tiny-llama"].revisions[revision] if name not in extras)
    path = resolve_model("acme/tiny-llama", revision=revision).path
    assert sorted(hub.fetched()) == [f"acme/tiny-llama/{name}" for name in needed]
    assert sorted(p.name for p in path.iterdir()) == needed
    requested = "\n".join(hub.paths())
    assert not [name for name in extras if name in requested]


def test_cached_model_loads_with_no_request_and_with_the_hub_stopped(hub, checkpoints):
    main = load_model("acme/tiny-llama", "float32").source.path
    v1 = resolve_model("acme/tiny-llama", revision="v1").path
    assert v1 != main
    count = len(hub.requests)
    assert resolve_model("acme/tiny-llama").path == main
    assert len(hub.requests) == count  # in the cache: the hub is not asked
    hub.stop()
    for revision, path in ((None, main), ("main", main), ("v1", v1), (v1.name, v1)):  # branch, tag, commit
        assert resolve_model("acme/tiny-llama", revision=revision).path == path
    np.testing.assert_array_equal(
        jserve_prompt_logits(load_model("acme/tiny-llama", "float32", revision="v1"), PROMPT),
        jserve_prompt_logits(load_model(checkpoints["v1"], "float32"), PROMPT),
    )


def test_a_lora_adapter_downloads_its_two_files_then_loads_from_the_cache(hub, checkpoints):
    batch = prompts(2, seed=4)
    local = LoRARequest("local", 1, str(checkpoints["lora"]))
    expected = token_ids(tiny_llm(checkpoints["local"], enable_lora=True).generate(batch, GREEDY, use_tqdm=False,
                                                                                 lora_request=local))  # fmt: skip
    hubbed = LoRARequest("hubbed", 2, "acme/tiny-llama-lora")
    llm = tiny_llm(checkpoints["local"], enable_lora=True)
    assert token_ids(llm.generate(batch, GREEDY, use_tqdm=False, lora_request=hubbed)) == expected
    assert sorted(hub.fetched()) == ["acme/tiny-llama-lora/adapter_config.json",
                                     "acme/tiny-llama-lora/adapter_model.safetensors"]  # fmt: skip
    hub.stop()
    again = tiny_llm(checkpoints["local"], enable_lora=True)
    assert token_ids(again.generate(batch, GREEDY, use_tqdm=False, lora_request=hubbed)) == expected


def test_download_dir_holds_the_download_and_is_looked_up(hub, cache, tmp_path):
    target = tmp_path / "models"
    path = resolve_model("acme/tiny-llama", download_dir=target).path
    assert path.parent == snapshot_of(target, "acme/tiny-llama")
    assert not cache.exists()
    hub.stop()
    assert resolve_model("acme/tiny-llama", download_dir=str(target)).path == path


def test_interrupted_download_resumes_with_a_range_request(hub, cache, checkpoints, monkeypatch):
    # huggingface_hub resumes from the last chunk it wrote, 10 MB by default: smaller ones let a tiny file resume.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16 << 10)
    hub.cut_short.add("acme/tiny-llama/model.safetensors")
    path = resolve_model("acme/tiny-llama", revision="v1").path
    expected = (checkpoints["v1"] / "model.safetensors").read_bytes()
    assert (path / "model.safetensors").read_bytes() == expected
    file = re.compile(r"/acme/tiny-llama/resolve/\w+/model\.safetensors")
    gets = [r for r in hub.requests if r.method == "GET" and file.fullmatch(r.path)]
    assert len(gets) == 2 and "range" not in gets[0].headers
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", gets[1].headers["range"])[1])
    assert 0 < resumed_at <= len(expected) // 2
    assert not list(cache.rglob("*.incomplete"))


@pytest.mark.parametrize(
    "model, gguf_file",
    [("acme/tiny-llama-GGUF:tiny-f32.gguf", None), ("acme/tiny-llama-GGUF", "tiny-f32.gguf")],
    ids=["org/name:FILE.gguf", "--gguf-file"],
)
def test_one_gguf_file_is_fetched_and_loaded(hub, checkpoints, model, gguf_file):
    loaded = load_model(model, "float32", gguf_file=gguf_file)
    assert loaded.source.kind == "gguf" and loaded.source.path.name == "tiny-f32.gguf"
    assert hub.fetched("HEAD") == hub.fetched("GET") == ["acme/tiny-llama-GGUF/tiny-f32.gguf"]
    assert not [path for path in hub.paths() if path.startswith("/api/models")]
    np.testing.assert_allclose(
        jserve_prompt_logits(loaded, PROMPT),
        jserve_prompt_logits(load_model(checkpoints["local"], "float32"), PROMPT),
        atol=1e-5,
        rtol=0,
    )
    hub.stop()
    assert resolve_model(model, gguf_file=gguf_file).path == loaded.source.path


def test_gguf_file_picks_one_of_a_local_folder(checkpoints):
    folder = checkpoints["gguf"]
    with pytest.raises(ModelLoadError, match="of several, --gguf-file picks one"):
        resolve_model(folder)
    assert resolve_model(folder, gguf_file="tiny-f16.gguf").path == folder / "tiny-f16.gguf"
    with pytest.raises(ModelLoadError, match="tiny-q4.gguf' does not exist"):
        resolve_model(folder, gguf_file="tiny-q4.gguf")


def test_revision_and_gguf_file_where_they_do_not_apply(checkpoints):
    with pytest.raises(ModelLoadError, match="--revision 'v1' picks a revision of a hub repo; .* is a local path"):
        resolve_model(checkpoints["local"], revision="v1")
    with pytest.raises(ModelLoadError, match="--gguf-file 'x.gguf' picks a file of a hub repo or a local folder"):
        resolve_model(checkpoints["gguf"] / "tiny-f32.gguf", gguf_file="x.gguf")
    with pytest.raises(ModelLoadError, match="the default model takes neither"):
        resolve_model(None, revision="v1")
    with pytest.raises(ModelLoadError, match="names the GGUF file 'a.gguf' but --gguf-file says 'b.gguf'"):
        resolve_model("acme/tiny-llama-GGUF:a.gguf", gguf_file="b.gguf")


# --- failures: one ModelLoadError naming the repo, revision and endpoint, and the way round the hub ----------


def failure(hub, model: str, revision: str, why: str) -> str:
    """The ModelLoadError message expected of a failed download, as a regex."""
    return rf"^could not download {re.escape(model)} \(revision {revision}\) from {re.escape(hub.url)}: {why}.*local"


def test_offline_mode_with_an_uncached_id(hub, monkeypatch):
    set_hf_env(monkeypatch, HF_HUB_OFFLINE="1")
    with pytest.raises(ModelLoadError, match=failure(hub, "acme/tiny-llama", "main", "HF_HUB_OFFLINE is set")):
        resolve_model("acme/tiny-llama")
    assert not hub.requests


def test_unreachable_hub(hub):
    hub.stop()
    with pytest.raises(ModelLoadError, match=failure(hub, "acme/tiny-llama", "main", "the hub could not be reached")):
        resolve_model("acme/tiny-llama")


def test_missing_repo(hub):
    with pytest.raises(ModelLoadError, match=failure(hub, "acme/no-such-model", "main", "no such repo.*HF_TOKEN")):
        resolve_model("acme/no-such-model")


def test_missing_revision(hub):
    with pytest.raises(ModelLoadError, match=failure(hub, "acme/tiny-llama", "v9", "the repo has no revision 'v9'")):
        resolve_model("acme/tiny-llama", revision="v9")


def test_missing_gguf_file(hub):
    model = "acme/tiny-llama-GGUF:tiny-q4.gguf"
    with pytest.raises(ModelLoadError, match=failure(hub, model, "main", "the repo has no file 'tiny-q4.gguf'")):
        resolve_model(model)


def test_repo_without_safetensors_weights(hub):
    expected = r"^acme/no-weights \(revision main\) has no \*\.safetensors weights .*FILE\.gguf.*local"
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model("acme/no-weights")
    assert "pytorch_model.bin" not in "\n".join(hub.paths())


def test_gated_repo_asks_for_hf_token_and_sends_it(hub, monkeypatch):
    with pytest.raises(ModelLoadError, match=failure(hub, "acme/gated-llama", "main", "the repo is gated.*HF_TOKEN")):
        resolve_model("acme/gated-llama")
    assert not [r for r in hub.requests if "authorization" in r.headers]
    hub.requests.clear()
    set_hf_env(monkeypatch, HF_TOKEN=TOKEN)
    assert resolve_model("acme/gated-llama").kind == "hf"
    to_repo = [r for r in hub.requests if "acme/gated-llama" in r.path]
    assert hub.fetched() and {r.headers.get("authorization") for r in to_repo} == {f"Bearer {TOKEN}"}


def test_cached_models_load_without_huggingface_hub_installed(hub, monkeypatch):
    path = resolve_model("acme/tiny-llama").path
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    assert resolve_model("acme/tiny-llama").path == path
    with pytest.raises(ModelLoadError, match=r"needs huggingface_hub \(pip install huggingface_hub\)"):
        resolve_model("acme/tiny-llama", revision="v1")


# --- the command line ------------------------------------------------------------------------------------------


def test_hub_flags_reach_engine_args():
    flags = ["--revision", "v1", "--download-dir", "/models", "--gguf-file", "tiny-f32.gguf"]
    for argv in (["generate", "hi", "--model", "acme/tiny-llama", *flags], ["serve", "acme/tiny-llama", *flags]):
        args = EngineArgs.from_cli_args(build_parser().parse_args(argv))
        assert (args.model, args.revision, args.download_dir, args.gguf_file) == (
            "acme/tiny-llama", "v1", "/models", "tiny-f32.gguf",
        )  # fmt: skip


def run_cli(hub, cache, tmp_path, *args):
    """`jserve` in a process of its own, started with HF_ENDPOINT set: huggingface_hub reads it as users' do."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"))
    return subprocess.run([sys.executable, "-m", "jserve", *args], env=env, capture_output=True, text=True, timeout=600)


def test_cli_generate_downloads_a_revision(hub, cache, tmp_path):
    done = run_cli(hub, cache, tmp_path, "generate", "The quick brown", "--raw", "--model", "acme/tiny-llama",
                   "--revision", "v1", "--max-tokens", "4", "--dtype", "float32", "--max-model-len", "64",
                   "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--kv-cache-memory",
                   str(tiny_kv_bytes(8)), "--no-enable-prefix-caching")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "acme/tiny-llama/model.safetensors" in hub.fetched()
    commit = (cache / "models--acme--tiny-llama" / "refs" / "v1").read_text()
    assert (snapshot_of(cache, "acme/tiny-llama") / commit / "model.safetensors").is_file()


def test_cli_missing_repo_is_one_clear_error(hub, cache, tmp_path):
    done = run_cli(hub, cache, tmp_path, "generate", "hi", "--model", "acme/no-such-model")
    assert done.returncode == 1
    assert f"could not download acme/no-such-model (revision main) from {hub.url}: no such repo" in done.stderr
    assert "Traceback" not in done.stderr
