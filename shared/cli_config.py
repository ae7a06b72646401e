"""`--config FILE`: long flag sets in a YAML file, as SGLang's launcher takes them.

The file is a mapping of flag names (`context-length` or `context_length`) to values; flags given on the
command line win over the file. A key that names no flag is an error (a typo must not be ignored).
"""
from __future__ import annotations

import argparse
from typing import Sequence

import yaml


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML file of flag: value pairs (command-line flags override it)")


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return parser.parse_args(argv)
    return parser.parse_args(config_argv(parser, known.config) + list(argv if argv is not None else _sys_argv()))


def _sys_argv() -> list[str]:
    import sys

    return sys.argv[1:]


def config_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The file's settings as command-line tokens, placed before the real ones so those win."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML ({e})")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag: value")
    by_flag = {opt: a for a in parser._actions for opt in a.option_strings}
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = by_flag.get(flag)
        if action is None or flag == "--config":
            negated = by_flag.get("--no-" + flag[2:])
            if negated is not None and isinstance(value, bool):
                if not value:
                    argv.append("--no-" + flag[2:])
                continue
            parser.error(f"--config {path}: unknown setting {key!r}")
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} must be true or false")
            if value:  # `disable-radix-cache: true` gives the flag; false leaves it out
                argv.append(flag)
            continue
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and shows every option's default (on/off flags need none: their
    name says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0 or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) if action.help else "(default: %(default)s)"
