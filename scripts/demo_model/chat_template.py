r"""ChatML chat template with compact tool calling for the bundled demo model.

The template renders ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message. When ``tools`` are
given, a system block lists one tool per line as compact JSON and asks for
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a user system message is merged
into that block. Assistant ``tool_calls`` (OpenAI/transformers form or flat ``{"name", "arguments"}``)
render as one ``<tool_call>`` per line after any content, and ``tool`` messages are wrapped in
``<tool_response>...</tool_response>``. Rendering is kept short because the demo model has a
2048-token context.
"""

from __future__ import annotations

TOOLS_PREAMBLE = "You can call these tools:\n"
TOOLS_INSTRUCTION = 'To call a tool, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- elif content is mapping -%}{{- content | tojson -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system='', has_system=false, start=0) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = render_content(messages[0]['content']) -%}"
    "{%- set ns.has_system = true -%}"
    "{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}"
    "{{- " + repr(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{{- {'name': fn['name'], 'description': fn['description'] | default(''),"
    " 'parameters': fn['parameters'] | default({})} | tojson + '\\n' -}}"
    "{%- endfor -%}"
    "{{- " + repr(TOOLS_INSTRUCTION) + " + '<|im_end|>\\n' -}}"
    "{%- elif ns.has_system -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- set role = message['role'] -%}"
    "{%- set text = render_content(message['content']) -%}"
    "{%- if role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>' + text + '</tool_response><|im_end|>\\n' -}}"
    "{%- elif role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + text -}}"
    "{%- for tc in message['tool_calls'] | default([], true) -%}"
    "{%- set call = tc['function'] if tc['function'] is defined else tc -%}"
    "{%- set args = call['arguments'] | default({}, true) -%}"
    "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>{\"name\": ' + call['name'] | tojson + ', \"arguments\": ' -}}"
    "{%- if args is string -%}{{- args -}}{%- else -%}{{- args | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + role + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
