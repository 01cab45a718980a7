"""Draft directories that serving engines load: SGLang, vLLM and speculators formats.

Every EAGLE-3 format is a directory with ``config.json`` and ``model.safetensors`` (no embedding: the
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

The modules split by family, each owning its layouts' writing, reading, checking and
recognising (a ``DraftLayout`` object each):

- ``eagle3``: an EAGLE-3 draft (and P-EAGLE's, the same layout with ``mask_token_id`` and
  ``mask_hidden``) in the three formats.
- ``dflash``: a DFlash draft, in the one layout vLLM and SGLang load, or speculators'.
- ``gguf``: llama.cpp's GGUF file of an EAGLE-3 or a DFlash draft.
- ``layout``: what a layout is to the dispatch (``DraftLayout``, ``Found``).
- ``directory``: a draft of any family -- ``LAYOUTS``, the one registry of layouts, each
  recognising only its own drafts; reading, writing and checking a draft through the layout
  that recognises it (``export --check``), and refusing a path none recognises.
- ``kinds``: the three formats (``DraftFormat``), their architecture names, the verifier.
- ``config``: the ``export`` config section (``python -m eagleforge.export``).
"""
