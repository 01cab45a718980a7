"""Real acceptance length: speculative decoding with an HF target and a trained draft.

``decoder.py`` runs the decoding with an EAGLE-3 draft, ``block_decoder.py`` with a block
draft (chain or tree drafting, greedy or sampled verification) over
``runners.py`` (the target and the draft with their caches), ``tree.py`` (the draft tree) and
``sampling.py`` (rejection sampling); ``config.py`` holds the `eval` config section,
``prompts.py`` reads prompt sets, ``report.py`` summarises, writes and logs the results; the
``python -m eagleforge.evaluate`` entry point ties them together.
"""
