"""eagleforge: train EAGLE-3 speculative-decoding draft heads."""

__version__ = "0.1.0"
