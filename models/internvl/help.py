"""What the caption command's help says of InternVL, by option (no torch: `--help` answers before
any model library loads; the registry gathers it, `registry.option_help`)."""

HELP = {
    "max_tiles": "InternVL: tiles of 256 tokens, plus a thumbnail, default the checkpoint's 12",
}
