"""The tiny reference models (bench.reference_models --tiny), trained once a session for the tests that need them."""
from __future__ import annotations

import contextlib
import io

import pytest


@pytest.fixture(scope="session")
def tiny_refmodels(tmp_path_factory):
    """(the models' directory, the argv that trained them, what the run printed)."""
    from bench import reference_models

    root = tmp_path_factory.mktemp("refmodels")
    argv = ["--tiny", "--out", str(root / "models"), "--results", str(root / "results"), "--parity-prompts", "2"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert reference_models.main(argv) == 0
    return str(root / "models"), argv, printed.getvalue()
