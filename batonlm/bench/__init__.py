"""`batonlm bench`: a load generator for any OpenAI-compatible server.

Modules: `datasets` (prompts from the bundled corpus), `arrivals` (Poisson schedule),
`client` (one streamed request, timed), `runner` (the load loop), `metrics` (summary),
`report` (table and the JSON schema), `plot` (`--plot`), `cli` (flags and entry point).
"""
