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


def test_rounds_alternate_the_order_and_report_medians(monkeypatch, tmp_path):
    """`--rounds 3`: our runs in the given order, then reversed, then as given; the JSON keeps
    every round and the medians, and the defaults over --no-graphs by the medians."""
    template = json.loads(SWEEP.read_text())["runs"]["defaults"]
    rates = {"defaults": 20.0, "no_graphs": 10.0, "defaults_r2": 40.0, "no_graphs_r2": 11.0,
             "defaults_r3": 10.0, "no_graphs_r3": 9.0}
    order = []

    def timed(folder, work, name, args, extra, gpus=1, label=None):
        order.append((label or name, name, tuple(extra)))  # the run's outputs, its configuration, its flags
        rate = rates.get(label or name, 1.0)
        return {**template, "wall_s": 100.0 / rate, "items_per_s_end_to_end": rate, "items_per_s_in_loop": 2 * rate}

    monkeypatch.setattr(bench_cli, "run_ours", timed)
    def written(args, folder):
        folder.mkdir()
        (folder / "a.png").write_bytes(b"")  # never read: the runs are stand-ins
        return {"kind": "photos", "files": 256}

    monkeypatch.setattr(bench_cli, "write_folder", written)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_cli.py", "--runs", "defaults,no_graphs", "--rounds", "3", "--json", str(out)])
    bench_cli.main()
    no = ("--no-graphs",)
    assert order == [("warm_up", "warm_up", ()), ("defaults", "defaults", ()), ("no_graphs", "no_graphs", no),
                     ("no_graphs_r2", "no_graphs", no), ("defaults_r2", "defaults", ()), ("defaults_r3", "defaults", ()),
                     ("no_graphs_r3", "no_graphs", no)]  # a later round runs the same configuration (shards, cold)
    written = json.loads(out.read_text())
    assert set(written["runs"]) == set(rates)
    rounds = written["rounds"]
    assert rounds["defaults"]["items_per_s_end_to_end"] == 20.0 and rounds["no_graphs"]["items_per_s_end_to_end"] == 10.0
    assert rounds["defaults"]["wall_s"] == 5.0 and rounds["no_graphs"]["items_per_s_in_loop"] == 20.0
    assert rounds["defaults_over_no_graphs"] == {"end_to_end": 2.0, "in_loop": 2.0}


def test_the_tree_id_names_the_code_measured_whatever_commit_git_says(tmp_path):
    """A benchmark's JSON names its code by tree id too: equal to the tree of a commit of those
    files, whatever the .git copy's HEAD; a file changed since makes it another; nothing is
    written into the repository."""
    import subprocess

    from timing import source, tree_id

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "a.py")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD^{tree}")
    assert tree_id(tmp_path) == first and source(tmp_path)["tree"] == first
    (tmp_path / "b.py").write_text("two\n")  # untracked: sent to the GPU machine all the same
    objects = git("count-objects")
    changed = tree_id(tmp_path)
    assert changed != first and git("count-objects") == objects
    git("add", "b.py")
    git("commit", "-qm", "second")
    assert git("rev-parse", "HEAD^{tree}") == changed


def test_rounds_give_medians_for_the_runs_and_the_sizes(monkeypatch):
    """`--rounds` repeats our runs and the `--sizes` pairs alike; the report's medians name each."""
    args = parsed(monkeypatch, "--runs", "defaults", "--sizes", "32", "--rounds", "3")

    def run(wall: float) -> dict:
        return {"wall_s": wall, "items_per_s_end_to_end": 10 / wall, "items_per_s_in_loop": 20 / wall}
    runs = {"defaults": run(3), "defaults_r2": run(1), "defaults_r3": run(2),
            "defaults_32": run(5), "no_graphs_32": run(6), "defaults_32_r2": run(4), "no_graphs_32_r2": run(8),
            "defaults_32_r3": run(9), "no_graphs_32_r3": run(7)}
    medians = bench_cli.round_medians(args, runs)
    assert medians["defaults"]["wall_s"] == 2 and medians["defaults_32"]["wall_s"] == 5
    assert medians["no_graphs_32"]["wall_s"] == 7 and medians["no_graphs_32"]["items_per_s_in_loop"] == 20 / 7
