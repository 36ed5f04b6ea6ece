"""Qwen3.5: the Qwen3-VL tower without deepstack levels; its `get_*_features` give each item's
merged features as `pooler_output`, as Qwen2-VL's do. The language model (Gated DeltaNet layers
beside full attention) decodes through its own forward over the runner's static cache, which
holds the linear layers' conv and recurrent states (`decoder/static_cache.py`)."""

from encoder_graphs.models.qwen.qwen3_vl import Qwen3TowerAdapter


class Qwen3_5Adapter(Qwen3TowerAdapter):
    pass
