"""A Python DSL for structured language-model programs; SGLang-frontend compatible names.

    import lang_client as sgl
    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))
    sgl.set_default_backend(sgl.RuntimeEndpoint("http://localhost:30000"))
    print(qa.run(question="Why is the sky blue?")["answer"])
"""
from lang_client.api import (assistant, assistant_begin, assistant_end, gen, gen_int, gen_string,
                             get_default_backend, image, select, set_default_backend, system, system_begin,
                             system_end, user, user_begin, user_end, video)
from lang_client.backends import BaseBackend, OpenAI, RuntimeEndpoint
from lang_client.chat_template import ChatTemplate, get_chat_template, template_for_model
from lang_client.choices import greedy_token_selection, token_length_normalized
from lang_client.errors import BackendError, LangError, NotSupportedError, TracingError
from lang_client.program import SglFunction, function
from lang_client.state import ProgramState, ProgramStateGroup
from lang_client.tracer import IR_VERSION

__version__ = "0.1.0"

__all__ = [
    "assistant", "assistant_begin", "assistant_end", "gen", "gen_int", "gen_string", "get_default_backend",
    "image", "select", "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin",
    "user_end", "video", "BaseBackend", "OpenAI", "RuntimeEndpoint", "ChatTemplate", "get_chat_template",
    "template_for_model", "greedy_token_selection", "token_length_normalized", "BackendError", "LangError",
    "NotSupportedError", "TracingError", "SglFunction", "function", "ProgramState", "ProgramStateGroup",
    "IR_VERSION",
]
