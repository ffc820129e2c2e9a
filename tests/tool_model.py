"""A tiny checkpoint that answers every chat with a tool call, for testing tool-calling clients.

Its blocks are those of the source checkpoint (so a swarm serving that one serves this one), its
tokenizer has a Hermes-style chat template that renders `tools` and one added token spelling a whole
call, and its embeddings and LM head are rewritten into a bigram model: a newline (where the template's
generation prompt ends) is followed by the call, the call by EOS. The blocks cannot change that: the
two tokens' embeddings are so large that the blocks' bounded additions (attention and MLP read
normalized inputs) barely turn the residual stream, and the final norm and LM head see their direction.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_tool_calling_checkpoint(source: Path, out: Path) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens([CALL_TEXT])
    tokenizer.chat_template = HERMES_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    assert len(newline) == 1, newline
    newline, call, eos = newline[0], tokenizer.convert_tokens_to_ids(CALL_TEXT), tokenizer.eos_token_id
    hidden = model.config.hidden_size
    with torch.no_grad():
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for token, axis in ((newline, 0), (call, 1)):
            embed[token] = torch.zeros(hidden)
            embed[token, axis] = 1000.0  # dwarfs what the blocks add
        for token, follows in ((call, 0), (eos, 1)):  # "\n" -> call -> EOS
            head[token] = torch.zeros(hidden)
            head[token, follows] = 50.0
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
