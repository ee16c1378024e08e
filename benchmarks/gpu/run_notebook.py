"""Run a notebook's code cells top to bottom in one namespace, without Jupyter (which GPU images may lack).

IPython's line magics and shell escapes (`%pip ...`, `!nvidia-smi`) are not Python: each such line runs
as `pass`, so a cell that installs jserve only where it is missing keeps its meaning where jserve is
installed. Figures go to matplotlib's non-interactive backend. A failing cell stops the run with its
number, source and traceback (exit status 1).

    python benchmarks/gpu/run_notebook.py notebooks/colab_gpu_demo.ipynb
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

MAGIC = re.compile(r"^(\s*)[%!].*$")


def code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]


def as_python(source: str) -> str:
    return "\n".join(MAGIC.sub(r"\1pass", line) for line in source.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("MPLBACKEND", "Agg")
    notebook = args.notebook.resolve()
    os.chdir(notebook.parent)  # as Jupyter runs it: relative paths from the notebook's folder
    namespace: dict = {"__name__": "__main__"}
    cells = code_cells(notebook)
    for number, source in enumerate(cells, 1):
        print(f"--- cell {number}/{len(cells)}", flush=True)
        start = time.perf_counter()
        try:
            exec(compile(as_python(source), f"<cell {number}>", "exec"), namespace)
        except Exception:
            print(f"cell {number} failed:\n{source}\n", file=sys.stderr)
            traceback.print_exc()
            return 1
        print(f"--- cell {number} done in {time.perf_counter() - start:.1f} s", flush=True)
    print(f"all {len(cells)} code cells ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
