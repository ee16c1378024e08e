"""The notebooks in notebooks/ run top to bottom on CPU, headless, and are committed without outputs.

Each notebook runs in a fresh IPython kernel (nbclient), with notebooks/ as its working directory. A failing
cell fails the test with that cell's source and traceback; the executed notebook is kept in the test's
tmp_path for a look at every output. The colab notebook runs twice: as on one CPU device (its tensor-parallel
cell says why it skips) and on four virtual CPU devices (that cell then runs).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # per cell; every notebook takes 20-120 s in all on two warm CPU cores
MISSING_EXTRA = "install jserve's test extra: pip install -e '.[test]'"

RUNS = {
    "quickstart": ("quickstart.ipynb", {}),
    "serving": ("serving.ipynb", {}),
    "rl_loop": ("rl_loop.ipynb", {}),
    "colab_gpu_demo": ("colab_gpu_demo.ipynb", {}),
    "colab_gpu_demo-4-cpu-devices": (
        "colab_gpu_demo.ipynb",
        {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()},
    ),
}


def test_every_notebook_is_executed():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    assert set(NOTEBOOKS) == {name for name, _ in RUNS.values()}, "add new notebooks to RUNS"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stripped(name):
    """Committed notebooks carry no outputs, execution counts or widget state: diffs stay readable and a
    stale output never passes for the current behaviour."""
    path = NOTEBOOK_DIR / name
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "widgets" not in nb["metadata"], f"{name}: widget state saved in the metadata"
    fix = "clear all outputs and save (or: jupyter nbconvert --clear-output --inplace notebooks/*.ipynb)"
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{name}, cell {index}: has outputs; {fix}"
            assert cell["execution_count"] is None, f"{name}, cell {index}: has an execution count; {fix}"
        assert "execution" not in cell.get("metadata", {}), f"{name}, cell {index}: execution timing metadata"
    nbformat = pytest.importorskip("nbformat", reason=f"the schema check needs nbformat: {MISSING_EXTRA}")
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch):
    """A 'python3' kernelspec that runs this interpreter: the installed spec may say plain `python`, which
    could be another environment's."""
    from ipykernel.kernelspec import write_kernel_spec

    jupyter_dir = tmp_path / "jupyter"
    write_kernel_spec(jupyter_dir / "kernels" / "python3")
    paths = [str(jupyter_dir), *filter(None, [os.environ.get("JUPYTER_PATH")])]
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(paths))
    return "python3"


def stop_process_group(pgid: int | None) -> None:
    """End whatever is left of the kernel's process group, e.g. a server a failed notebook never stopped:
    SIGTERM, then SIGKILL after 15 s. The kernel runs in a session of its own; never signal ours."""
    if pgid is None or pgid == os.getpgrp():
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(sys.platform == "win32", reason="the clean-up signals the kernel's process group (POSIX)")
@pytest.mark.parametrize("run", list(RUNS))
def test_notebook_runs(run, python3_kernel, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason=MISSING_EXTRA)
    nbclient = pytest.importorskip("nbclient", reason=MISSING_EXTRA)
    pytest.importorskip("ipykernel", reason=MISSING_EXTRA)
    from nbclient.exceptions import CellExecutionError

    name, env = RUNS[run]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=python3_kernel,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    groups: set[int] = set()

    def remember_kernel_group(**_):
        provisioner = getattr(client.km, "provisioner", None)
        pgid = getattr(provisioner, "pgid", None)
        if pgid is not None:
            groups.add(pgid)

    client.on_cell_execute = remember_kernel_group
    executed = tmp_path / name
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{name} failed (executed copy: {executed}):\n{err}", pytrace=False)
    finally:
        nbformat.write(nb, executed)
        for pgid in groups:
            stop_process_group(pgid)
    print(f"{run}: {time.perf_counter() - start:.1f} s")
