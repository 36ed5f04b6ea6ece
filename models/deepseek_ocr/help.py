"""What the caption command's help says of DeepSeek-OCR, by option (no torch: `--help` answers
before any model library loads; the registry gathers it, `registry.option_help`)."""

HELP = {
    "max_tiles": "DeepSeek-OCR: 768 px tiles of 144 tokens beside its view, 2 to N, default 6",
    "prompt": "DeepSeek-OCR: its model card's plain OCR instruction",
}
