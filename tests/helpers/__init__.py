"""Helpers the test tiers share (``pythonpath = ["tests"]`` in pyproject puts them on the path):
``helpers.ranks`` spawns gloo ranks, ``helpers.drafts`` builds tiny drafts and batches,
``helpers.processes`` makes processes to kill."""
