"""``specdec bench``'s library: prompts to send, two ways to run them, and what comes out.

- :mod:`.prompts`: the workload, as chat conversations (built-ins, JSONL, ShareGPT JSON).
- :mod:`.local`: in-process runs of several speculative methods on one loaded model, the
  methods taking turns batch by batch.
- :mod:`.remote`: streamed chat completions against any OpenAI-compatible server (specdec,
  llama-server, vLLM), with only standard request fields.
- :mod:`.results`: per-request samples, their summary per method and batch size, the table.
- :mod:`.plots`: the PNG plots (matplotlib, the ``bench`` extra).
"""
