"""Where the shared data sets live.

The data sets (MATH, GSM8K, six benchmarks) are kept beside the project, never inside it:
`<project root>/../shared/data` by default, or the directory named by `DPPO_DATA_DIR`.
"""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    """The directory holding math/, gsm8k/ and bench/; raises a clear error when it is absent."""
    configured = os.environ.get("DPPO_DATA_DIR")
    path = Path(configured) if configured else PROJECT_ROOT.parent / "shared" / "data"
    if not path.is_dir():
        raise FileNotFoundError(
            f"data directory {path} does not exist: set DPPO_DATA_DIR to the folder that holds "
            "math/, gsm8k/ and bench/ (by default it is ../shared/data beside the project root)"
        )
    return path
