"""bench_cli.py's own logic, without a GPU: which runs it refuses before anything is timed, and a
report that keeps every other run's numbers when one run could not start."""

import json
import sys
from pathlib import Path

import bench_cli
import pytest

SWEEP = Path(__file__).parents[1] / "benchmarks" / "bench_cli_photos_256_sweep_h200.json"


def parsed(monkeypatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["bench_cli.py", *argv])
    return bench_cli.parse_args()


@pytest.mark.parametrize("source", [["--clips", "4"], ["--mixed", "4,2"]])
def test_the_photo_only_peer_is_refused_for_clips(monkeypatch, capsys, source):
    with pytest.raises(SystemExit):
        parsed(monkeypatch, "--runs", "defaults,vllm", *source)
    assert "peer_vllm.py reads photos only" in capsys.readouterr().err


def test_a_peer_that_did_not_run_costs_its_row_only(monkeypatch, tmp_path, capsys):
    args = parsed(monkeypatch, "--images", "256", "--runs", "defaults,stock,vllm,vllm_warm", "--json", str(tmp_path / "r.json"))
    runs = dict(json.loads(SWEEP.read_text())["runs"])
    runs["vllm"] = {"error": "python3 peer_vllm.py exited 1:\nModuleNotFoundError: No module named 'vllm'"}
    runs["vllm_warm"] = {**runs["stock_batch_64"], "gpu_memory_is_card_use": True}
    bench_cli.report(args, runs, {"files": 256})
    shown = capsys.readouterr().out
    assert "vllm: did not run: ModuleNotFoundError: No module named 'vllm'" in shown
    assert "not the run's peak" in shown
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["runs"]["vllm"]["error"].endswith("'vllm'")
    assert written["stock_baseline"] == "stock_batch_64"
    assert set(written["speedup_over_peer"]) == {"vllm_warm"}
    assert written["speedup_over_peer"]["vllm_warm"] == pytest.approx(written["speedup_over_stock"])
