"""eagleforge: train speculative-decoding drafts (EAGLE-3 / 3.1 heads, DFlash block drafts,
P-EAGLE parallel drafts) for a frozen target LLM, served by vLLM and SGLang."""

__version__ = "0.1.0"
