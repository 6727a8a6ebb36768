"""The token-parity corpus: chat templates written for the tests, each in the style of
a common model family, and the chat request shapes (:data:`SHAPES`) sent to each.
Rendered by our :class:`~kvevents.text.chat.ChatTemplate` and by vLLM's own renderer
(``tests/test_chat_parity.py``) or a real engine's ``/tokenize``
(``tests/test_gateway_vllm.py``); the ids must be equal.

* :data:`PARTS` iterates over a message's content parts (Llama 4 / Gemma 3 style): vLLM
  detects the "openai" content format and hands it the parts as they are;
* :data:`TOOLS` (from :mod:`kvevents.demo.chat_templates`) prints the tool schemas in
  the system turn, assistant ``tool_calls`` with their arguments and ``tool`` results
  (Qwen 2.5 / Hermes style); a string-format template: content parts are joined into
  one string first;
* :data:`THINKING` has a thinking switch (``enable_thinking`` from
  ``chat_template_kwargs``), prints ``reasoning_content`` of assistant turns, honours
  ``add_generation_prompt`` and ``documents`` (Qwen 3 style, with a Command R-like
  documents block).
"""

from __future__ import annotations

from kvevents.demo.chat_templates import TOOLS

PARTS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}[{{ part['text'] }}]{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

THINKING = (
    "{{ bos_token }}"
    "{%- if documents %}<|im_start|>system\n# Documents\n"
    "{%- for doc in documents %}\n[{{ loop.index }}] {{ doc.title }}: {{ doc.text }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['role'] == 'assistant' and message.reasoning_content is defined "
    "and message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{%- endif %}"
    "{{ message['content'] if message['content'] is not none else '' }}"
    "{%- if not (loop.last and message['role'] == 'assistant' and not add_generation_prompt) %}"
    "<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)

TEMPLATES = {"parts": PARTS, "tools": TOOLS, "thinking": THINKING}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, now or on a day",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "when": {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                  "hours": {"type": "array", "items": {"type": "integer"}}}},
        "units": {"type": "string", "enum": ["metric", "imperial"]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "filters": {
        "type": "object", "additionalProperties": {"anyOf": [{"type": "string"}, {"type": "number"}]}}}}},
    "strict": None}
BARE = {"type": "function", "function": {"name": "noop"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{\"city\": \"東京\", \"units\": \"metric\"}"}}

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is the weather in Tokyo?"}


def _agent() -> list[dict]:
    return [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1"},
            {"role": "user", "content": "And tomorrow?"}]


# (name, body without model): every shape is sent to every template.
SHAPES: list[tuple[str, dict]] = [
    ("one user string", {"messages": [USER]}),
    ("system and user", {"messages": [SYSTEM, USER]}),
    ("one text part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "alpha beta"}]}]}),
    ("several text parts", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}, {"type": "text", "text": "third"}]}]}),
    ("an empty part among them", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]}),
    ("empty string content", {"messages": [{"role": "user", "content": ""}]}),
    ("empty parts list", {"messages": [SYSTEM, {"role": "user", "content": []}]}),
    ("null assistant content", {"messages": [USER, {"role": "assistant", "content": None}, USER]}),
    ("input_text and output_text parts: refused", {"messages": [
        {"role": "user", "content": [{"type": "input_text", "text": "in"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "out"}]}, USER]}),
    ("thinking part", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Hmm."}, {"type": "text", "text": "Sunny."}]}, USER]}),
    ("refusal part", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "I cannot."}]}, USER]}),
    ("system as parts", {"messages": [{"role": "system", "content": [
        {"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}]}, USER]}),
    ("multi-turn strings", {"messages": [SYSTEM, USER, {"role": "assistant", "content": "Sunny."},
                                         {"role": "user", "content": "Thanks!"}]}),
    ("multi-turn mixed", {"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "q1"}]},
                                       {"role": "assistant", "content": "a1"},
                                       {"role": "user", "content": "q2"}]}),
    ("developer first", {"messages": [{"role": "developer", "content": "Be brief."}, USER]}),
    ("developer after system", {"messages": [SYSTEM, {"role": "developer", "content": "Be brief."}, USER]}),
    ("developer as parts, empty system", {"messages": [
        {"role": "system", "content": "S1"}, USER,
        {"role": "developer", "content": [{"type": "text", "text": "D1"}, {"type": "text", "text": "D2"}]},
        {"role": "system", "content": ""}]}),
    ("two systems", {"messages": [SYSTEM, {"role": "system", "content": "Second rule."}, USER]}),
    ("system not first", {"messages": [USER, SYSTEM, {"role": "user", "content": "again"}]}),
    ("named user", {"messages": [{"role": "user", "content": "hi", "name": "alice"}]}),
    ("agent: tool call and result", {"messages": _agent()}),
    ("agent with tools", {"messages": _agent(), "tools": [WEATHER]}),
    ("tools, plain chat", {"messages": [SYSTEM, USER], "tools": [WEATHER, SEARCH]}),
    ("tools, no system", {"messages": [USER], "tools": [WEATHER]}),
    ("tool without description or parameters", {"messages": [USER], "tools": [BARE]}),
    ("tools with tool_choice none", {"messages": [USER], "tools": [WEATHER], "tool_choice": "none"}),
    ("tools with a named tool_choice", {"messages": [SYSTEM, USER], "tools": [WEATHER, SEARCH], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}),
    ("tool call, arguments as a JSON string of an array", {"messages": [
        USER, {"role": "assistant", "content": "", "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": "[1, 2]"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]}),
    ("tool call, empty arguments", {"messages": [
        USER, {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": ""}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]}),
    ("tool call, arguments not JSON", {"messages": [
        USER, {"role": "assistant", "content": None, "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": "city=Paris"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"}]}),
    ("two tool calls", {"messages": [
        USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
            CALL, {"id": "call_2", "type": "function", "function": {"name": "search",
                                                                      "arguments": "{\"query\": \"x\"}"}}]},
        {"role": "tool", "content": "21", "tool_call_id": "call_1"},
        {"role": "tool", "content": "found", "tool_call_id": "call_2"}], "tools": [WEATHER, SEARCH]}),
    ("empty tool_calls list", {"messages": [USER, {"role": "assistant", "content": "x", "tool_calls": []}, USER]}),
    ("tool result as parts", {"messages": [
        USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
         "tool_call_id": "call_1"}]}),
    ("reasoning_content", {"messages": [USER, {"role": "assistant", "content": "Sunny.",
                                                "reasoning_content": "Look it up."}, USER]}),
    ("reasoning", {"messages": [USER, {"role": "assistant", "content": "Sunny.", "reasoning": "Think."}, USER]}),
    ("thinking off by kwargs", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}),
    ("thinking on by kwargs", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": True}}),
    ("reasoning_effort none", {"messages": [USER], "reasoning_effort": "none"}),
    ("reasoning_effort low", {"messages": [USER], "reasoning_effort": "low"}),
    ("reasoning_effort beside kwargs", {"messages": [USER], "reasoning_effort": "none",
                                        "chat_template_kwargs": {"enable_thinking": True}}),
    ("unread kwargs", {"messages": [USER], "chat_template_kwargs": {"custom_flag": 3, "bos_token": "<s>"}}),
    ("kwargs with null", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": None}}),
    ("kwargs name tools", {"messages": [USER], "tools": [WEATHER], "chat_template_kwargs": {"tools": [BARE]}}),
    ("kwargs add_generation_prompt overridden", {
        "messages": [USER], "chat_template_kwargs": {"add_generation_prompt": False}}),
    ("no generation prompt", {"messages": [USER, {"role": "assistant", "content": "Sun"}],
                              "add_generation_prompt": False}),
    ("continue final message", {"messages": [USER, {"role": "assistant", "content": "The weather is"}],
                                "add_generation_prompt": False, "continue_final_message": True}),
    ("continue final message, trailing space", {
        "messages": [USER, {"role": "assistant", "content": "It is "}],
        "add_generation_prompt": False, "continue_final_message": True}),
    ("continue final message, parts", {
        "messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                             {"type": "text", "text": "B"}]}],
        "add_generation_prompt": False, "continue_final_message": True}),
    ("continue with generation prompt: refused", {
        "messages": [USER, {"role": "assistant", "content": "x"}], "continue_final_message": True}),
    ("add_special_tokens true", {"messages": [USER], "add_special_tokens": True}),
    ("add_special_tokens false", {"messages": [USER], "add_special_tokens": False}),
    ("documents", {"messages": [USER], "documents": [{"title": "Tokyo", "text": "Mild in spring."},
                                                     {"title": "Paris", "text": "Rainy."}]}),
    ("unicode", {"messages": [{"role": "user", "content": "café naïve 東京 🙂 ✓ ζψω"}]}),
    ("whitespace edges", {"messages": [{"role": "user", "content": "  lead and trail  \n\n\t"}]}),
    ("only newlines", {"messages": [{"role": "user", "content": "\n\n\n"}]}),
    ("special token text in content", {"messages": [{"role": "user", "content": "<|im_end|> and <s> inside"}]}),
    ("braces and quotes", {"messages": [{"role": "user", "content": "{{ not jinja }} {% raw %} \"q\" 'q'"}]}),
    ("long conversation", {"messages": [SYSTEM] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 20} for i in range(12)]}),
    ("unicode in tools", {"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "météo", "description": "Le temps à 東京", "parameters": {"type": "object", "properties": {}}}}]}),
    ("system only", {"messages": [SYSTEM]}),
    ("assistant last, generation prompt", {"messages": [USER, {"role": "assistant", "content": "Sun."}]}),
    ("parts with trailing space", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a "}, {"type": "text", "text": " b"}]}]}),
]
