"""The Docker image installs what pyproject declares (it lists the dependencies itself, to take torch
from the CUDA index): a dependency added to one and not the other would break `docker compose up`."""
from __future__ import annotations

import os
import re
import tomllib

from tests.conftest import ROOT


def test_dockerfile_installs_every_runtime_dependency_at_its_pinned_version():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        docker = f.read()
    pinned = dict(re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", d).groups() for d in deps)
    missing = [f"{name}=={version}" for name, version in pinned.items()
               if name != "torch" and f"{name}=={version}" not in docker]
    assert not missing, f"Dockerfile lacks {missing}"


def test_the_image_and_the_package_carry_lang_client():
    """services/gateway/program_exec.py imports lang_client.wire and lang_client.choices."""
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        assert "COPY lang_client ./lang_client" in f.read()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert "lang_client*" in tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
