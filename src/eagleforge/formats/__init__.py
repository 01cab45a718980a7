"""Draft directories that serving engines load: SGLang, vLLM and speculators formats.

Every format is a directory with ``config.json`` and ``model.safetensors`` (no embedding: the
engine shares the target's) holding ``fc.weight``, the decoder layer, ``norm.weight``,
``lm_head.weight``, ``d2t`` and ``t2d``. They differ in names and in the numbering of the aux
layers:

| format | architectures | layer tensors | aux layer ids |
|---|---|---|---|
| ``sglang`` | ``LlamaForCausalLMEagle3`` | ``midlayer.*`` | ``eagle_config.eagle_aux_hidden_state_layer_ids``, output of layer |
| ``vllm`` | ``Eagle3LlamaForCausalLM`` | ``layers.0.*`` | top-level ``eagle_aux_hidden_state_layer_ids``, input of layer (+1) |
| ``speculators`` | ``Eagle3Speculator`` | ``layers.0.*`` | as vllm, plus ``speculators_config`` naming the verifier |

eagleforge numbers aux layers by output-of-layer, 0-based (layer 1 = the output of the second
decoder layer), like SGLang. vLLM collects a layer's *input* (the previous layer's output),
so its numbers are one higher: the same three hidden states are [1, 15, 28] for SGLang and
[2, 16, 29] for vLLM on a 32-layer target.

- ``kinds``: the three formats (``DraftFormat``) and their architecture names.
- ``write``: writing a draft directory in a format.
- ``config``: the ``export`` config section (``python -m eagleforge.export``).
- ``read``: reading one back in any format (format, architecture, tensors).
- ``check``: every problem that would make a draft from any tool load wrongly.
"""
