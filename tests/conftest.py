"""Session-wide fixtures shared by the whole suite."""

import os
import sys
from pathlib import Path

import pytest
import torch

# the project is a flat layout: make its modules importable however pytest is started
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """
    Tiny models spend their time in per-op overhead, which a second thread only adds to; on cores shared with
    other jobs, two spinning threads per op made the training and sampling tests over ten times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """tinyshakespeare.txt from the offline mirror named by NANOFORMER_DATA_MIRROR."""
    mirror = os.environ.get("NANOFORMER_DATA_MIRROR")
    if not mirror:
        pytest.fail(
            "NANOFORMER_DATA_MIRROR is not set: export NANOFORMER_DATA_MIRROR=<folder holding "
            "tinyshakespeare.txt> (and TIKTOKEN_CACHE_DIR for BPE), as .ci/run does"
        )
    path = Path(mirror) / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.fail(f"{path} not found: NANOFORMER_DATA_MIRROR must name a folder holding tinyshakespeare.txt")
    return path


@pytest.fixture(scope="session")
def shakespeare_char_dir(shakespeare_path, tmp_path_factory) -> Path:
    """shakespeare_char, prepared once per session into a temporary data dir; returns its folder."""
    import prepare_data

    # no --input: the text comes through NANOFORMER_DATA_MIRROR, the documented offline route
    return prepare_data.prepare("shakespeare_char", data_dir=tmp_path_factory.mktemp("data"))
