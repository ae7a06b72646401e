"""Example programs; each module runs with `python -m lang_client.examples.<name> --url URL [--remote]`."""
