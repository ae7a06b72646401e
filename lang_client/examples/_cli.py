"""The few lines every example's main() shares: pick the server, maybe run remotely."""
from __future__ import annotations

import argparse

from lang_client import RuntimeEndpoint, set_default_backend


def setup(description: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default="http://localhost:30000", help="server speaking SGLang's native API")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--remote", action="store_true", help="run the traced program on the server")
    args = parser.parse_args(argv)
    set_default_backend(RuntimeEndpoint(args.url, api_key=args.api_key))
    return args
