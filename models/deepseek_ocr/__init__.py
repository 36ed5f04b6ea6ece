"""DeepSeek-OCR 2 (transformers' `DeepseekOcr2ForConditionalGeneration`): two vision paths, each
page's global view and its local tiles, graphed apart (`adapter.py`); its caption inputs, equal to
the official processor's (`inputs.py`); its presets (`presets.py`)."""
