"""The presets' names without importing torch or transformers: `--help` lists them
(`catalog.PRESETS` holds the presets; a test keeps the two the same)."""

PRESET_NAMES = (
    "tiny-qwen2-vl",
    "tiny-qwen2.5-vl",
    "tiny-qwen3-vl",
    "tiny-qwen3.5",
    "tiny-internvl",
    "tiny-deepseek-ocr-2",
    "qwen2-vl-2b",
    "qwen2.5-vl-3b",
    "qwen2.5-vl-7b",
    "qwen3-vl-2b",
    "qwen3.5-0.8b",
    "qwen3.5-2b",
    "qwen3.5-4b",
    "qwen3.5-vision",
    "internvl3-1b",
    "internvl3.5-2b",
    "internvl3-38b-vision",
    "deepseek-ocr-2",
)
