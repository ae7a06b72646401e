"""Chat templates written for the tests, in the styles of the two tool-calling families we parse, and a
writer of tiny HF checkpoints that carry them. They exercise what transformers' environment has and a
plain Jinja environment lacks: loop controls, `raise_exception`, `strftime_now`, `tojson` with options,
namespaces, tools, documents, `enable_thinking`, reasoning in history, tool results."""
from __future__ import annotations

import json
import os

# Qwen/Hermes style: ChatML, tools listed in the system turn, calls as <tool_call>{json}</tool_call>,
# tool results inside <tool_response> in a user turn, thinking switched off by an empty think block.
QWEN_STYLE = """{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

Call a function with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- if documents -%}
<|im_start|>system
{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}
{% endfor %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
{%- if m.role not in ['user', 'assistant', 'tool'] -%}{{ raise_exception('role ' + m.role + ' is not supported') }}{%- endif -%}
{%- if m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif +%}
<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content | trim }}
</think>

{% endif %}{{ m.content if m.content is string else '' }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{{ '\n' if m.content or not loop.first else '' }}<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{%- endif -%}"""

# Llama 3.x style: header ids, the date through strftime_now, tools as indented sorted JSON in the first
# user turn, calls as {"name": ..., "parameters": ...}, results under the ipython role.
LLAMA_STYLE = """{{- bos_token }}
{%- set date = date_string if date_string is defined else strftime_now('%d %b %Y') -%}
<|start_header_id|>system<|end_header_id|>

Cutting Knowledge Date: December 2023
Today Date: {{ date }}

{% if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif %}<|eot_id|>
{%- set ns = namespace(tools_done=false) -%}
{%- for m in messages -%}
{%- if loop.first and m.role == 'system' -%}{%- continue -%}{%- endif -%}
{%- if m.role == 'user' and tools and not ns.tools_done -%}
{%- set ns.tools_done = true -%}
<|start_header_id|>user<|end_header_id|>

Respond with {"name": function name, "parameters": dictionary of argument name and its value}.

{% for t in tools %}{{ t | tojson(indent=4, sort_keys=true) }}

{% endfor %}{{ m.content | trim }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls -%}
<|start_header_id|>assistant<|end_header_id|>

{% for call in m.tool_calls %}{% if loop.index > 1 %}; {% endif %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role in ['tool', 'ipython'] -%}
<|start_header_id|>ipython<|end_header_id|>

{{ m.content | tojson if m.content is mapping else m.content }}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content | trim }}{% if not (loop.last and continue_final_message is defined) %}<|eot_id|>{% endif %}
{%- endif -%}
{%- if m.role == 'user' and m.content == 'STOP' -%}{%- break -%}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""

# The tokenizer's special tokens are ChatML's; the Llama-style markers are plain text to it.
SPECIAL_TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


def write_chat_model(path: str, template: str, family: str = "qwen3") -> str:
    """A tiny random checkpoint (see hf_models) whose tokenizer_config carries `template`."""
    from tests.support.hf_models import make_hf_model, write_hf_checkpoint

    model = make_hf_model(family)
    model.config.max_position_embeddings = 2048  # tool schemas in the prompt outgrow the default 256
    write_hf_checkpoint(model, path)
    cfg_file = os.path.join(path, "tokenizer_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg.update(chat_template=template, bos_token=SPECIAL_TOKENS["bos_token"])
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    return path
