from __future__ import annotations

import pytest

from tests.kernels._runner import run_interpreted


@pytest.fixture(scope="session")
def interpreted_results(request):
    """The interpreted results of every check this session selected, from one set of workers for all the files."""
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if getattr(item, "originalname", "") == "test_interpreted_cpu" and hasattr(item, "callspec")
                    and item.module.__name__.startswith("tests.kernels.")})
    return run_interpreted(names)
