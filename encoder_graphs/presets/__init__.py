"""Named model configs: real sizes (values from the public config.json files) and tiny CPU ones,
each family's in its folder (`models/qwen/presets.py`, `models/internvl/presets.py`, gathered by
`catalog.py`); the checkpoint files
besides weights that every preset gets (`files.py`), and the embedded tiny default model.

Weights are random: presets exist to measure speed and to test equivalence, not to caption.
Names are exported lazily: the command line reads `names.PRESET_NAMES` without torch.
"""

from encoder_graphs.lazy import lazy_exports

_CATALOG = "encoder_graphs.presets.catalog"
_EXPORTS = {name: _CATALOG for name in ("PRESETS", "build_model", "build_vision_tower", "get_config")}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
