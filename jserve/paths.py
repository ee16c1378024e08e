"""Where jserve keeps what it fetches or builds: $JSERVE_CACHE, by default ~/.cache/jserve."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("JSERVE_CACHE") or Path.home() / ".cache" / "jserve")
