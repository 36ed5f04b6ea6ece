"""Qwen2-VL: per-frame attention segments and 2-D rotary; everything lives in the shared base."""

from encoder_graphs.models.qwen.vision import QwenVisionAdapter


class Qwen2VLAdapter(QwenVisionAdapter):
    pass
