"""vLLM as a process eagleforge runs and talks to: the judge of drafts (``evaluate``), the data
engine (``regenerate``) and the target whose hidden states are captured (``prepare``).

- ``config``: the ``vllm`` config section (the engine's interpreter or a server's URL, sizes).
- ``server``: one vLLM server as an owned child process, stopped on every way out.
- ``client``: completions of token-id prompts and the engine's speculative counters.

vLLM is never imported here: it runs in its own environment (``make vllm``), whose pins
(torch, transformers) differ from eagleforge's.
"""
