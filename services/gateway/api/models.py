"""Every public route's request body, declared once as msgspec Structs: decoded from the raw body in one
call (services/gateway/http/body.py), described by /openapi.json (services/gateway/openapi.py). Types and static
bounds live here; what depends on the model, the limits or other fields (context length, n caps, one
grammar per request, tenancy) is the admission step's (api/admission.py).

Unknown top-level fields are ignored, as OpenAI, vLLM and SGLang ignore them; inside `structured_outputs`
they are refused (a typo there would mean unconstrained output). vLLM extras we do not have are declared
so that giving them is a 400 naming them, never a silent no-op.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from msgspec import Meta, Struct

from services.gateway.programs.ir import ProgramRequest
from shared.limits import MAX_GRAMMAR_CHARS, MAX_RID_LEN, MAX_TOP_LOGPROBS

NonNegative = Annotated[int, Meta(ge=0)]
TokenIds = list[int]
Grammar = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]
NonEmptyGrammar = Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
NonEmptyText = Annotated[str, Meta(min_length=1)]


class _Body(Struct, kw_only=True, omit_defaults=True):
    model: str | None = None


# ---------------------------------------------------------------- OpenAI: completions and chat
class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM's; usage comes at the end either way


class JsonSchemaFormat(Struct, kw_only=True):
    name: str
    schema: dict[str, Any] | bool = {}
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's structured outputs: one constraint; the `disable_*` switches have no effect here, and what we
    lack (`whitespace_pattern`, `structural_tag`) is an unknown field, refused by the decoder."""
    json: dict[str, Any] | str | bool | None = None
    regex: NonEmptyGrammar | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: NonEmptyGrammar | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class _OpenAIBody(_Body, kw_only=True):
    """What /v1/completions and /v1/chat/completions share: choices, streaming, sampling (OpenAI's fields
    and the vLLM / SGLang extras clients send through extra_body), the output grammar."""
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: NonNegative | None = None
    user: str | None = None
    # sampling, passed to SamplingParams under SGLang's names (its ranges are checked there)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegative | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    include_stop_str_in_output: bool | None = None  # vLLM's name for no_stop_trim
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: the context length
    # the output's grammar: at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: NonEmptyGrammar | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: NonEmptyGrammar | None = None
    guided_decoding_backend: str | None = None  # a backend hint: ignored
    guided_whitespace_pattern: Any = None  # refused when given
    regex: Grammar | None = None
    json_schema: Grammar | None = None
    ebnf: Grammar | None = None
    # vLLM features this server does not have: refused when given
    use_beam_search: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    logits_processors: Any = None


class CompletionRequest(_OpenAIBody, kw_only=True):
    prompt: Union[str, list[Union[str, int, TokenIds]]]
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    suffix: Any = None  # refused when given


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class HistoryFunction(Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class HistoryCall(Struct, kw_only=True):
    function: HistoryFunction
    id: str | None = None
    type: str = "function"


Role = Literal["system", "developer", "user", "assistant", "tool"]


class Message(Struct, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[HistoryCall] | None = None


class Function(Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    function: Function
    type: Literal["function"] = "function"


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatRequest(_OpenAIBody, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Any = None  # OpenAI's deprecated function calling: refused when given
    function_call: Any = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_completion_tokens: NonNegative | None = None
    # the chat template's; vLLM's per-request `chat_template` is refused: it would run a caller's Jinja on the
    # server (vLLM too refuses it unless started with --trust-request-chat-template)
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # SGLang's reasoning switches: off, <think> stays in the content; streamed in one piece
    separate_reasoning: bool = True
    stream_reasoning: bool = True


# ---------------------------------------------------------------- SGLang-native /generate
_NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]+$"  # C0 and C1 controls (NEL, \x85, ends a line too)


def _per_item(t: Any) -> Any:
    """A field given once for every input, or as a list of one value per input."""
    return Union[t, list[t | None], None]


class GenerateRequest(_Body, kw_only=True):
    text: NonEmptyText | Annotated[list[NonEmptyText], Meta(min_length=1)] | None = None
    input_ids: list[Union[int, TokenIds]] | None = None
    # each a dict of SamplingParams' fields (unknown keys: a Warning header, a 400 with --strict)
    sampling_params: _per_item(dict[str, Any]) = None
    # No control characters: a rid reaches the workers' log lines, where a newline would forge one.
    rid: _per_item(Annotated[str, Meta(min_length=1, max_length=MAX_RID_LEN, pattern=_NO_CONTROL)]) = None
    return_logprob: _per_item(bool) = None
    logprob_start_len: _per_item(Annotated[int, Meta(ge=-1)]) = None
    top_logprobs_num: _per_item(Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]) = None
    return_text_in_logprobs: bool = False
    stream: bool = False


class NativeChoices(Struct, kw_only=True):
    """The fields of a native `sampling_params` the gateway reads itself (SamplingParams checks the rest)."""
    n: Annotated[int, Meta(ge=1)] = 1
    max_new_tokens: NonNegative | None = None


# ---------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(ChatRequest, kw_only=True):
    """Exactly one of `prompt` and `messages` (rendered as /v1/chat/completions renders them)."""
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    prompt: str | Annotated[list[str], Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body, kw_only=True):
    tokens: list[Union[int, TokenIds]]
    skip_special_tokens: bool = True


ROUTE_BODIES: dict[str, type] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
    "/generate": GenerateRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/programs": ProgramRequest,
}

