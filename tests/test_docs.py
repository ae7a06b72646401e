"""The README and docs/ against the code: the test command CI runs is the README's, every relative link
resolves (anchors included), every service flag the docs name is one a service's --help lists, and every
file or module they name exists (so a renamed module shows up here, in the page that still names it)."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Pages whose flags are the services' own (bench and kernel pages name their scripts' flags too).
FLAG_PAGES = [README] + [ROOT / "docs" / n for n in ("api.md", "architecture.md", "operating.md", "design.md")]
# Flags the docs name that belong to other programs: pip, docker compose, locust, vLLM, the examples,
# the benchmarks.
FOREIGN_FLAGS = {"--no-deps", "--profile", "--headless", "--prefix-share", "--max-tokens", "--api-server-count",
                 "--url", "--remote"}


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_ci_runs_the_readme_test_command():
    """.ci/run's last command is the README's test command (pip told to be quiet, nothing else added)."""
    readme_cmds = [b.strip() for b in _code_blocks(README.read_text()) if "pytest" in b]
    assert len(readme_cmds) == 1, readme_cmds
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert ci_lines[-1].replace("pip install -q ", "pip install ") == readme_cmds[0]


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 150


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


@pytest.fixture(scope="module")
def service_flags() -> set[str]:
    """Every flag the three services' --help lists (in process: the suite has imported them anyway)."""
    from services import launch
    from services.gateway import __main__ as gateway
    from services.worker import __main__ as worker

    helps = [launch.build_parser().format_help(), gateway.build_parser().format_help()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        worker.parse_args(["--help"])
    helps.append(out.getvalue())
    return {flag for text in helps for flag in re.findall(r"--[a-z][a-z0-9-]*", text)}


def test_flags_named_in_the_docs_exist(service_flags):
    unknown = {}
    for page in FLAG_PAGES:
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text()))
        missing = named - service_flags - FOREIGN_FLAGS
        if missing:
            unknown[page.name] = sorted(missing)
    assert not unknown, f"flags no service takes: {unknown}"


_PROJECT = ("services", "shared", "kernels", "lang_client", "bench", "tests", "loadtest")
# A path in the repository: not a route (`/v1/models`), not part of a URL.
_PATH = re.compile(r"(?<![/\w:.-])(?:[\w.-]+(?:/[\w.-]*)*\.(?:py|sh|md|yml|json|toml)|[\w.-]+(?:/[\w.-]+)*/)")


def _names_in(span: str, base: Path | None) -> tuple[list[Path], Path | None]:
    """Files a backticked span names; a bare file name is looked up beside the last path named before it
    in the same table cell (`shared/engine/sampler.py`, `penalties.py`), else at the root."""
    found = []
    for m in re.finditer(r"python -m ([\w.]+)", span):
        if m.group(1).split(".")[0] not in _PROJECT:
            continue
        mod = ROOT / m.group(1).replace(".", "/")
        found.append(mod if mod.is_dir() else mod.with_suffix(".py"))
    for token in _PATH.findall(re.sub(r"python -m [\w.]+|\w+://\S*", "", span)):
        if "/" in token:
            path = ROOT / token
            base = path if token.endswith("/") else path.parent
        else:
            path = base / token if base is not None and (base / token).exists() else ROOT / token
        found.append(path)
    return found, base


@pytest.mark.parametrize("page", FLAG_PAGES, ids=lambda p: p.name)
def test_named_files_and_modules_exist(page: Path):
    missing = []
    for line in page.read_text().splitlines():
        for cell in line.split("|"):
            base = None
            for span in re.findall(r"`([^`]+)`", cell):
                if re.search(r"\s-[\w-]|\.(?:jinja)$|^\.\[", span) and "python -m" not in span:
                    continue  # a command line with flags, a user's file, an extra
                paths, base = _names_in(span, base)
                missing += [p.relative_to(ROOT).as_posix() for p in paths if not p.exists()]
    assert not missing, f"{page.name} names what does not exist: {sorted(set(missing))}"
