"""The InternVL family: the adapter over InternViT's tiles (`adapter.py`), the caption inputs
with their tiling (`inputs.py`), the presets."""
