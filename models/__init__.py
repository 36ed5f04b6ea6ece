"""Model families, one folder each (`qwen/`, `internvl/`, `deepseek_ocr/`: adapter over the stock
transformers modules, caption inputs, presets, rewrites only that family takes), beside what they
share: the registry that finds a model's family, the one seam to transformers' internals
(`seam/`), attention backends (`attention/`), Triton kernels and their guards (`kernels/`), the
decode layers (`text/`), the rewrite recorder and shared weight re-layouts (`rewrites/`), and the preset
catalog (`presets/`).

Names are exported lazily: importing one module here (the seam, a kernel) loads no adapter.
"""

from encoder_graphs.lazy import lazy_exports

_EXPORTS = {
    "adapter_for": "encoder_graphs.models.registry",
    "family_for_config": "encoder_graphs.models.registry",
    "supported_architectures": "encoder_graphs.models.registry",
    "Qwen2VLAdapter": "encoder_graphs.models.qwen.qwen2_vl",
    "Qwen2_5_VLAdapter": "encoder_graphs.models.qwen.qwen2_5_vl",
    "Qwen3VLAdapter": "encoder_graphs.models.qwen.qwen3_vl",
    "Qwen3_5Adapter": "encoder_graphs.models.qwen.qwen3_5",
    "QwenVisionAdapter": "encoder_graphs.models.qwen.vision",
    "VisionBatch": "encoder_graphs.models.qwen.vision",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
