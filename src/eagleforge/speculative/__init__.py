"""Real acceptance length: speculative decoding with an HF target and a trained EAGLE-3 draft.

``decode.py`` runs the decoding (chain or tree drafting, greedy or sampled verification),
``prompts.py`` reads prompt sets, ``report.py`` summarises, writes and logs the results; the
``python -m eagleforge.evaluate`` entry point ties them together.
"""
