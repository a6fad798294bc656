"""Where the built-in data sets live.

The built-in sets (MATH, GSM8K, six benchmarks) are kept beside the project, never inside it:
`<project root>/../shared/data` by default, or the directory named by `DPPO_DATA_DIR`. A fresh clone has neither;
`where_data_is()` says so in words a user can act on.
"""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR_VARIABLE = "DPPO_DATA_DIR"


def data_dir() -> Path:
    """DPPO_DATA_DIR, or ../shared/data beside the project root; it may not exist (see `where_data_is`)."""
    configured = os.environ.get(DATA_DIR_VARIABLE)
    return Path(configured) if configured else PROJECT_ROOT.parent / "shared" / "data"


def where_data_is() -> str:
    """How the data directory was chosen and whether it exists, for error messages."""
    configured = os.environ.get(DATA_DIR_VARIABLE)
    if configured:
        state = "exists" if Path(configured).is_dir() else "does not exist"
        return f"{DATA_DIR_VARIABLE}={configured} ({state})"
    state = "exists" if data_dir().is_dir() else "is absent"
    return f"{DATA_DIR_VARIABLE} is not set and ../shared/data beside the project ({data_dir()}) {state}"


def shared_data_dir() -> Path:
    """The directory holding math/, gsm8k/ and bench/; raises a clear error when it is absent."""
    path = data_dir()
    if not path.is_dir():
        raise FileNotFoundError(
            f"no data directory: {where_data_is()}; set {DATA_DIR_VARIABLE} to the folder that holds math/, gsm8k/ "
            "and bench/ (docs/data_and_rewards.md lists the files and where they come from)"
        )
    return path
