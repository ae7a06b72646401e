"""Our chat rendering equals transformers' `apply_chat_template(tokenize=False)`, character for character,
on templates that use loop controls, raise_exception, strftime_now, tojson options, namespaces, tools,
documents, chat_template_kwargs, add_generation_prompt and continue_final_message."""
from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from shared.chat_template import ChatTemplateError, render_chat
from shared.tokenizer import Tokenizer, build_tiny_hf_tokenizer
from tests.support.chat_templates import LLAMA_STYLE, QWEN_STYLE, SPECIAL_TOKENS

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo <actuelle> d'une ville & \"quotes\" — 天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Bonjour <b>é</b>"}],
    "system": [{"role": "system", "content": "Be brief. 日本"}, {"role": "user", "content": "hi"}],
    "tool_round": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL],
         "reasoning_content": "I should call the tool."},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "клар"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "second"},
        {"role": "user", "content": "Thanks"}],
    "history_reasoning": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "partial answer", "reasoning_content": "new thoughts"}],
    "break": [{"role": "user", "content": "STOP"}, {"role": "user", "content": "never shown"}],
}


@pytest.fixture(scope="module")
def hf():
    return PreTrainedTokenizerFast(tokenizer_object=build_tiny_hf_tokenizer(), **SPECIAL_TOKENS)


def ours(template, messages, **kw):
    tok = Tokenizer(raw=build_tiny_hf_tokenizer(), chat_template=template, **SPECIAL_TOKENS)
    return tok.apply_chat_template(messages, **kw)


def theirs(hf, template, messages, **kw):
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)


CASES = [
    # (template, conversation, keyword arguments)
    (QWEN_STYLE, "plain", dict(add_generation_prompt=True)),
    (QWEN_STYLE, "system", dict(add_generation_prompt=True, tools=TOOLS)),
    (QWEN_STYLE, "tool_round", dict(add_generation_prompt=True, tools=TOOLS)),
    (QWEN_STYLE, "tool_round", dict(add_generation_prompt=True, tools=TOOLS, enable_thinking=False)),
    (QWEN_STYLE, "plain", dict(add_generation_prompt=True, enable_thinking=False)),
    (QWEN_STYLE, "plain", dict(add_generation_prompt=False, documents=[
        {"title": "Doc <1>", "text": "ünï"}, {"title": "Doc 2", "text": "two"}])),
    (QWEN_STYLE, "history_reasoning", dict(add_generation_prompt=False, continue_final_message=True)),
    (LLAMA_STYLE, "plain", dict(add_generation_prompt=True, date_string="26 Jul 2024")),
    (LLAMA_STYLE, "tool_round", dict(add_generation_prompt=True, tools=TOOLS, date_string="26 Jul 2024")),
    (LLAMA_STYLE, "break", dict(add_generation_prompt=True, date_string="1 Jan 2025")),
    (LLAMA_STYLE, "system", dict(add_generation_prompt=False, continue_final_message=True,
                                 date_string="1 Jan 2025")),
    (LLAMA_STYLE, "system", dict(add_generation_prompt=True)),  # strftime_now: today's date, both sides
]


@pytest.mark.parametrize("template,conv,kw", CASES, ids=lambda x: x if isinstance(x, str) and len(x) < 30 else "")
def test_rendering_equals_transformers(hf, template, conv, kw):
    messages = CONVERSATIONS[conv]
    expected = theirs(hf, template, messages, **kw)
    assert ours(template, messages, **kw) == expected


def test_tojson_keeps_non_ascii_and_html(hf):
    text = ours(QWEN_STYLE, CONVERSATIONS["system"], tools=TOOLS)
    assert "Météo <actuelle> d'une ville & \\\"quotes\\\" — 天气" in text
    llama = ours(LLAMA_STYLE, CONVERSATIONS["plain"], tools=TOOLS, date_string="x")
    assert '\n    "function": {\n        "description"' in llama  # indent=4, sort_keys=true


def test_break_and_continue_parse_and_run():
    text = ours(LLAMA_STYLE, CONVERSATIONS["break"], date_string="x")
    assert "STOP" in text and "never shown" not in text


def test_raise_exception_is_a_template_error(hf):
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="role wizard is not supported"):
        ours(QWEN_STYLE, bad)
    with pytest.raises(Exception, match="role wizard is not supported"):
        theirs(hf, QWEN_STYLE, bad)


def test_continue_final_message_leaves_the_last_turn_open():
    text = ours(QWEN_STYLE, CONVERSATIONS["history_reasoning"], add_generation_prompt=False,
                continue_final_message=True)
    assert text.endswith("partial answer")
    with pytest.raises(ChatTemplateError):
        ours(QWEN_STYLE, CONVERSATIONS["plain"], add_generation_prompt=True, continue_final_message=True)


def test_sandbox_still_refuses_attribute_escapes():
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])


def test_template_loaded_from_disk_with_break_serves(tmp_path):
    import json

    from shared.tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = LLAMA_STYLE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.load(str(tmp_path))
    assert "<|start_header_id|>assistant" in tok.apply_chat_template(CONVERSATIONS["break"])
