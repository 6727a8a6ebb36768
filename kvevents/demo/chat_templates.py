"""Chat templates in the styles of common model families, for the demo's tiny model, the
benchmarks and the token-parity tests (the tiny model's own template iterates over
content parts; most families' do not).

* :data:`STRING` — the "string" content format (vLLM joins a message's text parts
  into one string before rendering), one turn per message, as most model families.
* :data:`TOOLS` — prints the tool schemas in the system turn, assistant ``tool_calls``
  with their arguments and ``tool`` results (the Qwen 2.5 / Hermes style): agent
  traffic, whose tool schemas make the longest shared prefixes.

Write one into a model directory as ``chat_template.jinja`` (engines and the gateway's
``--tokenizer`` read it there), or hand it to ``vllm serve --chat-template``.
"""

from __future__ import annotations

STRING = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

TOOLS = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}You are a helpful assistant.{%- endif %}"
    "\n\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools><|im_end|>\n"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant"
    "{%- if message.content %}\n{{ message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{%- if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{%- else %}{{ tool_call.arguments | tojson }}{%- endif %}"
    "}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response id=\"{{ message.tool_call_id }}\">\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
