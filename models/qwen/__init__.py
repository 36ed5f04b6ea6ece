"""The Qwen family: one vision adapter over the stock towers (`vision.py`) and a subclass per
generation (Qwen2-VL, Qwen2.5-VL with its window attention and fused blocks, Qwen3-VL with its
deepstack levels, Qwen3.5 with the same tower without them); the caption inputs (`inputs.py`,
pixels and patches in `pixels.py`); the weight rewrites only Qwen2.5-VL's tower takes; the presets."""
