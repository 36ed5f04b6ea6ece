"""Where the caption command's time goes on the host: the command run in-process under cProfile on
a generated photo folder, the functions with the most cumulative time printed (a function that
waits for the GPU, as `.tolist()` does, carries the GPU time it waited for).
    python3 benchmarks/profile_caption.py [--preset qwen2.5-vl-3b] [--images 256] [--top 45] [CAPTION ARGS...]
"""

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

from photos import write_photo_folder

from encoder_graphs.app.cli import main as caption_main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-vl-3b")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--top", type=int, default=45)
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "photos"
        write_photo_folder(folder, args.images)
        argv = ["caption", str(folder), "--model", args.preset, "--out", f"{work}/out.jsonl", "--quiet", *extra]
        profile = cProfile.Profile()
        code = profile.runcall(caption_main, argv)
    stats = pstats.Stats(profile, stream=sys.stdout).strip_dirs().sort_stats("cumulative")
    stats.print_stats(args.top)
    stats.sort_stats("tottime").print_stats(25)
    sys.exit(code)


if __name__ == "__main__":
    main()
