"""Qwen3.5: the Qwen3-VL tower without deepstack levels; its `get_*_features` give each item's
merged features as `pooler_output`, as Qwen2-VL's do. The language model (Gated DeltaNet layers
beside full attention) is not graphed: `generate` stays stock (`decoder/runner.py` says why)."""

from encoder_graphs.models.qwen.qwen3_vl import Qwen3TowerAdapter


class Qwen3_5Adapter(Qwen3TowerAdapter):
    pass
