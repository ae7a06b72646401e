"""What a deployment builds from, checked without a Docker engine: the image installs exactly pyproject's
pins (requirements in their own layer, before the source), on a base that can compile Triton's launchers;
the compose file is valid under the Compose Specification's schema and starts the topologies that
`services.launch` starts, with flags the services accept."""
from __future__ import annotations

import json
import os
import re
import tomllib
from importlib import metadata

import jsonschema
import pytest
import yaml

from tests.support.stack import ROOT

_PIN = re.compile(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)")


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for req in requirements:
        m = _PIN.fullmatch(req)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _docker_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in _read("Dockerfile").splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


# ---------------------------------------------------------------- pyproject
def test_every_dependency_is_pinned_and_pd_is_an_extra():
    project = _pyproject()
    extras = project["optional-dependencies"]
    for req in project["dependencies"] + [r for group in extras.values() for r in group if "[" not in r]:
        assert _PIN.fullmatch(req), f"{req!r} is not pinned with =="
    assert not any(name.startswith(("ucxx", "rmm", "libucx")) for name in _pins(project["dependencies"]))
    assert "ucxx-cu13" in _pins(extras["pd"])
    assert "radixserve[pd]" in extras["test"]  # the tests exercise PD


def test_test_extra_triton_is_what_torch_requires():
    """torch 2.13.0's Linux wheel (CUDA 13) pins triton==3.7.1; a different pin cannot resolve there. This
    machine's CPU torch build has no triton requirement, so the pin is also checked against the value
    read from that wheel's metadata (recorded here)."""
    test_pins = _pins(_pyproject()["optional-dependencies"]["test"])
    assert _pins(_pyproject()["dependencies"])["torch"] == "2.13.0" and test_pins["triton"] == "3.7.1"
    required = [r for r in (metadata.requires("torch") or []) if r.startswith("triton")]
    for req in required:
        m = re.match(r"triton\s*==\s*([0-9.]+)", req)
        assert m and m.group(1) == test_pins["triton"], req


# ---------------------------------------------------------------- Dockerfile
def test_dockerfile_installs_pyprojects_pins_and_nothing_else():
    project = _pyproject()
    wanted = {**_pins(project["dependencies"]), **_pins(project["optional-dependencies"]["pd"])}
    docker = _read("Dockerfile")
    installed = {m.group(1).lower(): m.group(2) for m in _PIN.finditer(docker)}
    assert installed == wanted, f"Dockerfile {installed} != pyproject {wanted}"


def test_dockerfile_layers_requirements_before_source_on_a_base_that_compiles():
    steps = _docker_instructions()
    base = next(args for op, args in steps if op == "FROM")
    apt = " ".join(args for op, args in steps if op == "RUN" and "apt-get install" in args)
    # Triton builds its launchers with a C compiler against the Python headers at run time.
    assert "devel" in base or ("gcc" in apt and "python3-dev" in apt), base
    assert "gcc" in apt and "python3-dev" in apt
    first_source = next(i for i, (op, args) in enumerate(steps) if op == "COPY" and re.search(r"\b(services|shared)\b", args))
    deps = next(i for i, (op, args) in enumerate(steps) if op == "RUN" and "torch==" in args)
    assert deps < first_source, "requirements must be installed before the source is copied (layer cache)"
    project_install = next(i for i, (op, args) in enumerate(steps) if op == "RUN" and "--no-deps" in args)
    assert project_install > first_source


def test_dockerignore_keeps_the_context_to_what_the_image_copies():
    ignore = [ln.strip() for ln in _read(".dockerignore").splitlines() if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "start from nothing (models, .git, venvs stay out of the build context)"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    copied = set()
    for op, args in _docker_instructions():
        if op == "COPY":
            copied.update(p.rstrip("/") for p in args.split()[:-1] if not p.startswith("--"))
    assert copied <= allowed, f"COPY sources not in the context: {copied - allowed}"
    assert not allowed - copied, f"context holds what no COPY uses: {allowed - copied}"


# ---------------------------------------------------------------- docker-compose.yml
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(_read("docker-compose.yml"))


def test_compose_file_is_valid_under_the_compose_spec_schema(compose):
    with open(os.path.join(ROOT, "tests", "data", "compose-spec.json")) as f:
        schema = json.load(f)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def _interpolate(value: str) -> str:
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), value)


def _services(compose: dict, profile: str) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if profile in svc.get("profiles", [])}


def _workers(compose: dict, profile: str) -> list[tuple[str, dict]]:
    return [(name, svc) for name, svc in _services(compose, profile).items()
            if svc["command"][:3] == ["python", "-m", "services.worker"]]


def test_compose_services_restart_get_hf_token_and_share_ipc(compose):
    for name, svc in compose["services"].items():
        assert svc.get("restart") in ("unless-stopped", "on-failure", "always"), name
        assert svc.get("profiles"), f"{name}: every service belongs to a topology's profile"
        if name != "redis":
            assert "HF_TOKEN" in svc["environment"], name
    for profile in ("unified", "pd", "tp"):
        for name, svc in _workers(compose, profile):
            assert svc["ipc"] == "host" and svc["healthcheck"]["start_period"]
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert all(d["capabilities"] == ["gpu"] for d in devices)


@pytest.mark.parametrize("profile,launch_argv", [
    ("unified", []),
    ("pd", ["--topology", "pd", "--worker-gpus", "0,1"]),
    ("tp", ["--tp-size", "2"]),
])
def test_compose_profiles_start_what_launch_starts(compose, profile, launch_argv, monkeypatch):
    """Same worker roles in the same order, on the same GPUs, with flags the worker and gateway parse."""
    from services.gateway.__main__ import build_parser as gateway_parser
    from services.launch import parse_args as launch_args
    from services.launch import worker_roles
    from services.worker.__main__ import parse_args as worker_args

    monkeypatch.setattr("shared.pd.ucx_available", lambda: True)
    launch = launch_args(["--model-path", "m", *launch_argv])
    expected_roles = worker_roles(launch)
    workers = _workers(compose, profile)
    parsed = [worker_args([_interpolate(a) for a in svc["command"][3:]]) for _, svc in workers]
    assert [a.role for a in parsed] == expected_roles
    if launch.worker_gpus:
        gpus = launch.worker_gpus.split(",")
        assert [a.device for a in parsed] == [f"cuda:{gpus[i % len(gpus)]}" for i in range(len(parsed))]
    assert [a.tp_size for a in parsed] == [launch.tp_size] * len(parsed)
    for (name, svc), args in zip(workers, parsed):
        assert args.redis_url == "redis://redis:6379/0" and args.advertise_host == name
        if args.tp_size > 1:  # one GPU per rank reserved for the container
            (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert int(_interpolate(str(dev["count"]))) == args.tp_size
        assert args.worker_id.startswith(args.role)
        if args.role == "decode":
            assert args.transfer_port > 0  # a fixed port other containers can reach
    gateway = _services(compose, profile)["gateway"]
    gw = gateway_parser().parse_args([_interpolate(a) for a in gateway["command"][3:]])
    assert gw.redis_url == "redis://redis:6379/0" and gw.host == "0.0.0.0"
    for name, _ in workers:
        assert gateway["depends_on"][name]["condition"] == "service_healthy"



def test_the_image_and_the_package_carry_lang_client():
    """services/gateway/programs/execute.py imports lang_client.wire and lang_client.choices."""
    assert "COPY lang_client ./lang_client" in _read("Dockerfile")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert "lang_client*" in tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
