from lang_client.backends.base import BaseBackend, Prompt
from lang_client.backends.openai import OpenAI
from lang_client.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "Prompt", "OpenAI", "RuntimeEndpoint"]
