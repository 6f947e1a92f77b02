"""Tool calling: the formats models write calls in, parsed into OpenAI's `tool_calls`, and the
JSON schema that forces a call when `tool_choice` requires one."""
