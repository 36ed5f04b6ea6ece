"""The fidelity targets on a GPU, one family a test (tests/fidelity.py says what is measured):
real-size language models with random weights, bf16, the "quick" workload (twelve images of
different sizes and a video, left padded, 48 greedy tokens each; DeepSeek-OCR twelve pages and no
video), through the model's own processor-style inputs, over three seeds' images, pooled (1,872
steps; 1,728). Ours, ours compiled and
the stock `generate` run a second time against its first run, teacher-forced through the model
in fp32; each item's encoder output against fp32.

    python3 -m pytest -q -s tests/test_fidelity_gpu.py          # about two minutes a family (H100)
"""

import gc
import json
from dataclasses import replace

import pytest
import torch
from fidelity import FAMILIES, SEEDS, measure, pooled, workload_for

from encoder_graphs.app.loading import load_model, open_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.xdist_group("fidelity"),  # two copies of a real-size model: one such test at a time
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ours_meets_the_fidelity_targets(family):
    source = open_model(FAMILIES[family])
    model, inputs = load_model(source, torch.device("cuda")), source.inputs
    try:
        assert model.dtype == torch.bfloat16
        results = [measure(model, inputs, replace(workload_for(family, "quick"), seed=seed)) for seed in SEEDS]
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()  # the next family compiles afresh, as in a process of its own
    for name, variant in [(name, v) for r in results for name, v in r["variants"].items()]:
        graphs = variant.get("graphs")
        if graphs is not None:  # ours: every call and step through the graphs, nothing sent to stock
            assert graphs["generate_fallbacks"] == {} and graphs["compile_error"] is None, (name, graphs)
            assert graphs["decode_graph_steps"] == graphs["decode_steps"] > 0, (name, graphs)
            assert graphs["encoder_graph_items"] == graphs["encoder_items"] > 0, (name, graphs)
    result = pooled(results)
    print(f"\n{family} ({FAMILIES[family]}): " + json.dumps({**result, "items": len(result["items"])}, indent=1))
    stock = result["variants"]["stock"]
    assert stock["agree"] > 0.8 * stock["steps"]  # random weights, yet the stock generate mostly agrees
    assert not result["missed_targets"], "\n".join(result["missed_targets"])
