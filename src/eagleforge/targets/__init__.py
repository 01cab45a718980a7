"""Target backends: the frozen LLM whose hidden states feed the draft and whose distribution it learns.

A backend turns a batch of token ids into the three aux hidden states and the final (normed)
hidden state (``base.TargetBackend``, ``base.TargetOutput``); the teacher is then computed
through the target's lm_head (``teacher.py``).

- ``hf`` (``hf.py``): transformers in-process, any decoder-only model, TP via transformers' plan.
- ``sglang`` (``sglang.py``, planned by ``sglang_launch.py``, translated by
  ``sglang_layout.py``): SGLang's model runner in-process with its EAGLE-3 aux capture (CUDA,
  the ``eagleforge[sglang]`` extra).
- ``custom`` (``custom.py``): our own Llama/Qwen implementation, tensor-parallel over the
  mesh's tp axis, loading safetensors shard by shard.

``registry.build_target`` picks one from the ``target`` config section (``config.py``);
``source.py`` holds the ``model`` section and where the weights come from, ``masks.py`` the
attention masks of packed rows, ``head.py`` the layer-less target of offline training.
"""
