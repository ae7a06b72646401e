"""The gateway's flags and the launcher's copies of them (services/gateway/cli.py declares them once): every
gateway flag can be given to `services.launch`, means the same there (type, choices, help), and reaches
the gateway as given; a flag the user did not give is not passed on, so the gateway's default applies."""
from __future__ import annotations

import argparse

import pytest

from services.gateway.__main__ import build_parser as gateway_parser
from services.gateway.cli import GATEWAY_FLAGS
from services.launch import _gateway_argv
from services.launch import build_parser as launch_parser
from services.launch import parse_args as launch_args

# Gateway flags the launcher declares itself, on purpose; each says why.
STACK_WIDE = {  # the launcher's own value, used for the whole stack and always passed to the gateway
    "--model-path": "the engine's model (workers and gateway)",
    "--redis-url": "workers register there too",
    "--host": "the gateway's address (workers listen on 127.0.0.1)",
    "--port": "the gateway's port",
    "--drain-timeout": "workers drain too",
    "--drain-grace": "workers drain too",
    "--log-level": "every service",
}
NOT_FORWARDED = {  # no launcher flag gives the gateway this
    "--workers": "the launcher's --workers is a count; it passes the addresses of the workers it started",
    "--context-length": "the launcher's is the engine's maximum; the gateway learns it from the workers",
    "--internal-key": "the launcher hands its key through the environment, never argv (which `ps` shows)",
    "--config": "each parser reads its own file",
    "--listen-fd": "set by a --gateway-processes pool for each of its processes (hidden)",
    "--process-index": "set by a --gateway-processes pool for each of its processes (hidden)",
    "--help": "argparse's",
}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}


def test_every_gateway_flag_can_be_given_to_the_launcher_with_the_same_meaning():
    gw, la = _options(gateway_parser()), _options(launch_parser())
    shared = {flag for flag, _ in GATEWAY_FLAGS}
    unaccounted = set(gw) - shared - set(STACK_WIDE) - set(NOT_FORWARDED)
    assert not unaccounted, f"gateway flags the launcher cannot pass on (add them to services/gateway/cli.py): " \
                            f"{sorted(unaccounted)}"
    assert not shared & (set(STACK_WIDE) | set(NOT_FORWARDED))
    for flag in set(STACK_WIDE) | set(NOT_FORWARDED):
        assert flag in gw, f"{flag} is no longer a gateway flag: drop it from this test's lists"
    for flag in shared | set(STACK_WIDE):
        g, lnch = gw[flag], la.get(flag)
        assert lnch is not None, f"the launcher does not take the gateway's {flag}"
        assert (type(lnch), lnch.type or str, lnch.choices, lnch.nargs, lnch.dest) == \
               (type(g), g.type or str, g.choices, g.nargs, g.dest), flag
    for flag in shared:
        # Same text (the launcher's adds only that it is the gateway's, and the gateway's default).
        assert la[flag].help.startswith(gw[flag].help), flag
        assert la[flag].default is None and "gateway flag" in la[flag].help, flag
        if gw[flag].default not in (None, False) and "default" not in gw[flag].help:
            assert f"default: {gw[flag].default})" in la[flag].help, flag


def test_only_the_flags_given_reach_the_gateway():
    """Nothing given: the gateway gets none of its own flags and keeps its defaults."""
    args = launch_args(["--model-path", "m"])
    argv = _gateway_argv(args, ["127.0.0.1:1"])
    assert not {flag for flag, _ in GATEWAY_FLAGS} & set(argv)
    gw, defaults = gateway_parser().parse_args(argv), gateway_parser().parse_args(["--model-path", "m"])
    for flag, _ in GATEWAY_FLAGS:
        dest = flag[2:].replace("-", "_")
        assert getattr(gw, dest) == getattr(defaults, dest), flag


def _sample_value(action: argparse.Action):
    """A value other than the gateway's default, as a command-line token."""
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if action.type is int:
        return str((action.default or 0) + 7)
    return "x-" + action.dest


def test_every_flag_given_to_the_launcher_reaches_the_gateway_as_given():
    gw_actions = _options(gateway_parser())
    argv = ["--model-path", "m", "--host", "0.0.0.0", "--port", "31234", "--redis-url", "redis://h:1/0",
            "--drain-timeout", "3.5", "--drain-grace", "0.25", "--log-level", "debug"]
    expected = {"model_path": "m", "host": "0.0.0.0", "port": 31234, "redis_url": "redis://h:1/0",
                "drain_timeout": 3.5, "drain_grace": 0.25, "log_level": "debug", "workers": "127.0.0.1:1"}
    for flag, spec in GATEWAY_FLAGS:
        action = gw_actions[flag]
        if spec.get("action") == "store_true":
            argv.append(flag)
            expected[action.dest] = True
        else:
            value = _sample_value(action)
            argv += [flag, value]
            expected[action.dest] = action.type(value) if action.type else value
    gw = gateway_parser().parse_args(_gateway_argv(launch_args(argv), ["127.0.0.1:1"]))
    assert {k: getattr(gw, k) for k in expected} == expected


@pytest.mark.parametrize("flags,forwarded", [
    (["--pd-bypass-tokens", "0"], ["--pd-bypass-tokens", "0"]),  # 0 (off) is a value, not "unset"
    (["--routing-policy", "cache-aware"], ["--routing-policy", "cache-aware"]),
    (["--api-key", ""], []),  # an empty value is not passed on
])
def test_forwarding_edge_cases(flags, forwarded):
    argv = _gateway_argv(launch_args(["--model-path", "m", *flags]), ["127.0.0.1:1"])
    tail = argv[argv.index("--drain-grace") + 2:]
    assert tail == forwarded


def test_a_config_file_sets_gateway_flags_on_the_launcher(tmp_path):
    cfg = tmp_path / "stack.yaml"
    cfg.write_text("model-path: m\nstrict: true\ndisable_fork_hint: false\nrouting-policy: prefix-affinity\n"
                   "max-n: 4\n")
    argv = _gateway_argv(launch_args(["--config", str(cfg)]), ["127.0.0.1:1"])
    gw = gateway_parser().parse_args(argv)
    assert gw.strict and not gw.disable_fork_hint and gw.routing_policy == "prefix-affinity" and gw.max_n == 4
