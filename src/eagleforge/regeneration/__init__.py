"""Rewriting a data set's assistant turns with the target (``python -m eagleforge.regenerate``).

Each conversation keeps its user, system and tool turns; every assistant turn is generated
again by the target, conditioned on the *regenerated* history. The result is OpenAI-format
jsonl (``{"id", "messages"}``), which ``data=jsonl data.path=...`` trains on.

Rows are processed in chunks of ``regenerate.chunk_rows``. A finished chunk is written
atomically to ``<output>.chunks/``, named by the source rows it covers, and never redone: the
same command after a kill regenerates only the rows no chunk covers (whatever chunk_rows it
uses). The settings that define the data (source rows, model, sampling) are written there
before the first chunk; a resumed job with other settings is refused. When every row is done
the chunks are joined into ``output`` and the settings kept as ``<output>.settings.json``.
Requests that still fail after the retries are left out and recorded, with the reason, in
``<output>.failed.jsonl``.

With ``regenerate.magpie.num_prompts`` the target writes the first user turns too (Magpie, Xu
et al. 2024): each is sampled from the chat template's user header, the text up to where a
user's message would start, so the prompts come from the target's own idea of what users
ask. They are written to ``<output>.chunks/prompts.jsonl`` before any is answered (a resume
reuses them), then answered like rows read from ``data``; ``magpie.held_out`` more are written
unanswered beside the output (``regen.jsonl`` -> ``regen.heldout.jsonl``, ``eval.prompts``
rows): prompts for validating a draft that never saw them.

- ``config.py``: the ``regenerate`` config section (``RegenerateConfig``, ``MagpieConfig``).
- ``rows.py``: the source rows, and one chunk of them regenerated turn by turn through any
  backend.
- ``backends.py``: the backends that write the replies (an OpenAI-compatible server, or the
  target in this process).
- ``magpie.py``: the prompts the target writes itself.
- ``output.py``: the job's files: chunks, the settings they were made with, the joined output.

The job itself, ``run``, is in ``eagleforge/regenerate.py``.
"""
