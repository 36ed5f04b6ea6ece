"""Model families, one folder each (`qwen/`, `internvl/`, `deepseek_ocr/`: adapter over the stock
transformers modules, caption inputs, presets, rewrites only that family takes), the registry that
finds a model's family, and what several families share (`common/`: input batching, the PIL
processors' normalisation). What serves every family but is no family's knowledge lives in
`encoder_graphs/`: the transformers seam (`seam/`), attention backends, Triton kernels, the rewrite
stack, the preset machinery and catalog, and the decode layers (`decoder/layers/`).

Names are exported lazily: importing one module here loads no adapter.
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
