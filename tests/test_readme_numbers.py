"""The README's headline numbers are the JSON's: every number in the first table ("What a user
sees") is found in the run of the JSON its heading names, and each ratio stated under it is
`benchmarks/timing.py: over_stock` of that JSON's runs: ours against the stock script's best
batch on as many files (issue 44)."""

import json
import re
from pathlib import Path

import pytest
from timing import over_stock, speedup

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Each row's label and file count -> its run in the JSON (bench_cli.py's names).
RUNS = {
    ("`encoder-graphs caption` (defaults)", "256"): "defaults",
    ("the same, a fresh machine's first run (`cold`: empty kernel caches)", "256"): "cold",
    ("the same, `--no-graphs`", "256"): "no_graphs",
    **{(f"a stock script: processor + `generate`, batch {batch}", "256"): f"stock_batch_{batch}"
       for batch in (32, 64, 128)},
}


def headline() -> tuple[dict, list[list[str]], str]:
    """The JSON the heading names, the first table's rows (cells), and the text after it."""
    start = README.index("**What a user sees**")
    heading = README[start:README.index("\n", start)]
    (name,) = re.findall(r"`(benchmarks/[\w.]+\.json)`", heading)
    table_at = README.index("\n|", start) + 1
    lines = README[table_at:].split("\n")
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    after = README[table_at + sum(len(line) + 1 for line in lines[: 2 + len(rows)]):]
    return json.loads((ROOT / name).read_text()), rows, after[: after.index("\n\n", 1)]


def test_every_number_of_the_first_table_is_the_jsons():
    data, rows, _ = headline()
    assert len(rows) == len(RUNS)
    for label, files, end_to_end, in_loop, first in rows:
        run = data["runs"][RUNS[label, files]]
        assert run["images"] == int(files.replace(",", "")), label
        assert end_to_end == f"{run['images_per_s_end_to_end']:.1f}", (label, files)
        assert in_loop == f"{run['images_per_s_in_loop']:.1f}", (label, files)
        assert first == f"{run['first_caption_after_load_s']:.1f} s", (label, files)


def test_the_ratio_under_it_is_speedup_of_runs_of_the_same_files():
    data, _, text = headline()
    stated = re.search(r"the same (\d+) files the defaults ran \*\*([\d.]+)x\*\* the stock script at its best batch"
                       r"\s+end to end and\s+\*\*([\d.]+)x\*\* in the loop", text)
    assert stated, text
    paired = over_stock(data["runs"])
    assert data["runs"][paired["speedup_of"]]["images"] == int(stated[1])
    ratio = paired["speedup_over_stock"]
    assert (stated[2], stated[3]) == (f"{ratio['end_to_end']:.1f}", f"{ratio['in_loop']:.1f}")


def rerun_h100() -> dict:
    """An older run of 1,024 files for ours and 256 for the stock script (at batch 8 alone)."""
    return json.loads((ROOT / "benchmarks/bench_cli_photos_rerun_h100.json").read_text())["runs"]


def test_speedup_refuses_runs_of_different_counts():
    runs = rerun_h100()
    with pytest.raises(ValueError, match="1024 and 256 files"):
        speedup(runs["defaults"], runs["stock"])  # 1,024 files against 256


def test_bench_cli_pairs_the_stock_script_with_ours_on_as_many_files():
    """`timing.over_stock`, what bench_cli.py records: the stock script's best batch against the
    run of ours of its file count, or no ratio where ours ran none."""
    runs = json.loads((ROOT / "benchmarks/bench_cli_photos_256_sweep_h200.json").read_text())["runs"]  # 8 to 64
    paired = over_stock(runs)
    assert (paired["stock_baseline"], paired["speedup_of"]) == ("stock_batch_64", "defaults")
    assert paired["speedup_over_stock"] == speedup(runs["defaults"], runs["stock_batch_64"])
    older = rerun_h100()
    paired = over_stock(older)
    assert paired["speedup_of"] == "defaults_256"
    assert paired["speedup_over_stock"] == speedup(older["defaults_256"], older["stock"])
    out_of_memory = {**runs, "stock_batch_128": {"batch_size": 128, "out_of_memory": "CUDA out of memory"}}
    assert over_stock(out_of_memory) == over_stock(runs)  # a batch that did not run is no baseline
    only = {"defaults": runs["defaults"], "stock_batch_8": out_of_memory["stock_batch_128"]}
    assert over_stock(only)["speedup_over_stock"] is None and "out of memory" in over_stock(only)["no_speedup"]
    alone = {name: run for name, run in older.items() if name in ("defaults", "stock")}
    assert over_stock(alone)["speedup_over_stock"] is None and "1024 and 256" in over_stock(alone)["no_speedup"]


def test_the_vllm_paragraph_is_its_jsons():
    """Every number of the README's vLLM paragraph is the run its JSONs hold (vLLM's call, then
    ours on the same GPU), at the precision shown, and the ratios are `timing.speedup`'s."""
    from timing import speedup

    start = README.index("**Against vLLM**")
    text = README[start:README.index("\n\n", start)]
    peer_name, ours_name = re.findall(r"`(benchmarks/[\w.]+\.json)`", text)
    runs = json.loads((ROOT / peer_name).read_text())["runs"]
    cold, warm = runs["vllm"], runs["vllm_warm"]
    ours = json.loads((ROOT / ours_name).read_text())["runs"]["defaults"]
    said = " ".join(text.split())
    ratio = speedup(ours, warm)
    for phrase in (f"ran {cold['images_per_s_end_to_end']:.1f} images/s end to end on its first start",
                   f"({cold['start_s']:.1f} s to its first generate",
                   f"and {warm['images_per_s_end_to_end']:.1f} on a second start ({warm['start_s']:.1f} s)",
                   f"where the defaults ran {ours['images_per_s_end_to_end']:.1f}",
                   f"vLLM ran {warm['images_per_s_in_loop']:.1f} images/s and the defaults {ours['images_per_s_in_loop']:.1f}",
                   f"({ratio['in_loop']:.1f}x)", f"**{ratio['end_to_end']:.1f}x** warm vLLM",
                   f"{warm['input_wait_pct']:.0f}% of vLLM's loop",
                   f"(ours {ours['start_s']:.1f} s to the loop)",
                   f"vLLM** {cold['settings']['vllm']}"):
        assert phrase in said, phrase


def test_the_4096_photo_sentence_is_its_jsons():
    """The 4,096-photo ratio: ours against the stock script's two halves, combined by
    `timing.in_parts` (files over summed times), then `timing.speedup`."""
    from timing import in_parts

    start = README.index("On 4,096 photos")
    said = " ".join(README[start:README.index("\n\n", start)].split())
    names = re.findall(r"`(?:benchmarks/)?(bench_cli_photos_4096[\w.]+\.json)`", said)
    ours_name, *halves = names
    ours = json.loads((ROOT / "benchmarks" / ours_name).read_text())["runs"]["defaults"]
    parts = [json.loads((ROOT / "benchmarks" / name).read_text())["runs"]["stock"] for name in halves]
    assert len(parts) == 2 and sum(part["images"] for part in parts) == ours["images"] == 4096
    ratio = speedup(ours, in_parts(parts))
    assert (f"ran {ours['images_per_s_end_to_end']:.1f} images/s end to end and "
            f"{ours['images_per_s_in_loop']:.1f} in the loop, {ratio['end_to_end']:.1f}x and "
            f"{ratio['in_loop']:.1f}x the stock script") in said
