"""The gateway's own flags, declared once: the gateway's parser takes them with their real defaults, and
`services.launch` in forward-only mode (every default None), passing on just those the user gave. Flags
of the whole stack, or that the launcher means differently, each parser declares itself
(tests/gateway/test_cli.py checks the two stay in step)."""
from __future__ import annotations

import argparse

from services.gateway.api import reasoning, tool_parsers
from services.gateway.limits import Limits
from services.gateway.programs.limits import ProgramBudget

ROUTING_POLICIES = ["cache-aware", "prefix-affinity"]

# (flag, add_argument keywords); `default` is the gateway's.
GATEWAY_FLAGS: tuple[tuple[str, dict], ...] = (
    ("--tokenizer-path", dict(default=None, help="defaults to --model-path")),
    ("--served-model-name", dict(default=None, help="the model's name in the API (default: --model-path)")),
    ("--routing-policy", dict(default="cache-aware", choices=ROUTING_POLICIES,
                              help="cache-aware: prefer the worker that was sent the longest part of the prompt "
                                   "before; prefix-affinity: hash the prompt's head")),
    ("--pd-bypass-tokens", dict(type=int, default=128,
                                help="PD: a decode worker known to hold all of a prompt but at most this many "
                                     "trailing tokens computes them itself, no prefill worker or KV transfer "
                                     "(0: off)")),
    ("--api-key", dict(default=None, help="Bearer key(s), comma-separated, required on /v1/* and /generate")),
    ("--admin-api-key", dict(default=None, help="Bearer key required on /flush_cache")),
    ("--max-programs-per-key", dict(type=int, default=ProgramBudget.max_running_per_key,
                                    help="/v1/programs requests one API key (or the anonymous tenant) may run "
                                         "at once; more get 429")),
    ("--disable-fork-hint", dict(action="store_true",
                                 help="/v1/programs: start a fork's branches without first prefilling their "
                                      "shared prefix once (the fork prefix hint that lets every branch hit the "
                                      "radix cache); for ablations")),
    ("--max-n", dict(type=int, default=Limits.max_n, help="most choices (n) one request may ask for")),
    ("--max-body-bytes", dict(type=int, default=Limits.max_body_bytes,
                              help="larger request bodies are refused with 413")),
    ("--strict", dict(action="store_true",
                      help="refuse unknown sampling parameters with 400 (default: accept, with a Warning header)")),
    ("--chat-template", dict(default=None,
                             help="a Jinja chat template file (.jinja) used instead of the tokenizer's own")),
    ("--tool-call-parser", dict(default=None, type=str.lower, choices=sorted(tool_parsers.ALIASES), metavar="NAME",
                                help="format of tool calls in the model's output: hermes (Qwen, Hermes: "
                                     "<tool_call>) or llama3 (Llama 3.x JSON); default: detected from the chat "
                                     "template")),
    ("--gateway-processes", dict(type=int, default=1,
                                 help="gateway processes accepting on the one port (as vLLM's --api-server-count): "
                                      "each a whole gateway with its own worker connections; /metrics covers "
                                      "them all; for data-parallel stacks whose token rate one Python process "
                                      "cannot carry")),
    ("--reasoning-parser", dict(default=None, type=str.lower, choices=sorted(reasoning.ALIASES), metavar="NAME",
                                help="split <think>...</think> into reasoning_content: qwen3, qwen3-thinking or "
                                     "deepseek-r1")),
)


def add_gateway_args(parser: argparse.ArgumentParser, *, forward_only: bool = False) -> None:
    """Declare the gateway's flags on `parser`. forward_only (the launcher): every default is None, so a
    flag the user did not give stays None and is not passed on (the gateway's own default applies, and
    --help says which it is)."""
    target = parser.add_argument_group("gateway") if forward_only else parser
    for flag, spec in GATEWAY_FLAGS:
        if forward_only:
            said = spec.get("action") == "store_true" or "default" in spec["help"]  # no default, or its own
            note = " (gateway flag)" if said else f" (gateway flag; default: {spec.get('default')})"
            spec = {**spec, "default": None, "help": spec["help"] + note}
        target.add_argument(flag, **spec)


def gateway_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The gateway flags given to a forward-only parser, as the gateway's command line."""
    argv: list[str] = []
    for flag, spec in GATEWAY_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)  # argparse's dest for the flag
        if value is None or value is False or value == "":
            continue  # not given (an empty value is not passed on either, as before)
        if spec.get("action") == "store_true":
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv
