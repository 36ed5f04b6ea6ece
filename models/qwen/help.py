"""What the caption command's help says of the Qwen-VL families, by option (no torch: `--help`
answers before any model library loads; the registry gathers it, `registry.option_help`).
A resolution option named here is one of `QwenVLInputs.resolution_arguments` (a test holds them
the same)."""

HELP = {
    "max_image_tokens": "Qwen-VL: N x 784 pixels for Qwen2/2.5-VL, N x 1024 for Qwen3-VL and Qwen3.5, 'model' "
    "Qwen2.5-VL's 16384 tokens (12.8 MP)",
    "max_frame_tokens": "Qwen-VL: N x 784 pixels a frame for Qwen2/2.5-VL, N x 1024 for Qwen3-VL and Qwen3.5, "
    "'model' Qwen2.5-VL's 768",
    "video_fps": "Qwen-VL's video processors take 2",
}
