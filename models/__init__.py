"""Model families (one adapter each over the stock transformers modules), the registry that finds
them, the one seam to transformers' internals, attention backends, presets and small models.

Names are exported lazily: importing one module here (the seam, the toy ViT) loads no adapter.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "adapter_for": "encoder_graphs.models.registry",
    "family_for_config": "encoder_graphs.models.registry",
    "supported_architectures": "encoder_graphs.models.registry",
    "Qwen2VLAdapter": "encoder_graphs.models.qwen2_vl",
    "Qwen2_5_VLAdapter": "encoder_graphs.models.qwen2_5_vl",
    "Qwen3VLAdapter": "encoder_graphs.models.qwen3_vl",
    "QwenVisionAdapter": "encoder_graphs.models.qwen_vision",
    "VisionBatch": "encoder_graphs.models.qwen_vision",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'encoder_graphs.models' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
