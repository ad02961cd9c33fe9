"""The `LM` wrapper (lm.py) and what it runs on: its KV caches, attention, int8 copies and the zoo of real weights."""
