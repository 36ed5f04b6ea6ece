"""A clean undo on CUDA (bf16 tiny models), where enable also rewrites what only runs on a GPU:
Qwen2.5-VL's window attention (q/k dims permuted in qkv), its MLPs (gate/up interleaved into one
weight for the swiglu kernel, after padding) and its chained blocks, and the decoder runner's
stacked q/k/v and gate/up under captured graphs. After `disable()`, in or out of
`torch.inference_mode()`, and after an enable that fails after real captures, the model is as it
was (tests/test_undo.py's `Snapshot`: the same parameter objects, values, `requires_grad`, kind
and strides, no attribute or hook left) and gives the same outputs as before enable; while
enabled, `state_dict()` and `save_pretrained` give the stock weights. The only registrations
left are ours: attention functions named `encoder_graphs_*` and ops `encoder_graphs::*`."""

import pytest
import torch
from synthetic_prompts import random_pixels
from test_undo import Snapshot, assert_an_optimizer_made_before_still_trains, load, mixed_requires_grad, raise_at_call
from transformers import AutoModelForImageTextToText
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import encoder_graphs.models.qwen.qwen2_5_vl as qwen2_5_vl
from encoder_graphs import DecoderGraphRunner, enable_cuda_graphs
from encoder_graphs.kernels import triton_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-internvl"]
GRIDS = [(1, 8, 12), (1, 22, 14)]


@pytest.fixture(scope="module", autouse=True)
def registries_warm(tmp_path_factory):
    """One enable and disable before the tests: the first enable in a process imports modules of
    torch's that register their own operators (on the H100 the first test, and only it, saw new
    ops outside `encoder_graphs::`), which are not ours to leave or undo. After it, an enable may
    add nothing but our names."""
    model = cuda_model(FAMILIES[1], tmp_path_factory.mktemp("warm"))
    enable(model).disable()
    outputs(model)


def cuda_model(name: str, directory) -> torch.nn.Module:
    """The tiny checkpoint of `name`, read back, in bf16 on the GPU (where the kernels take it)."""
    return load(name, directory).to("cuda", torch.bfloat16)


def enable(model: torch.nn.Module):
    budgets = [4, 16] if model.config.model_type == "internvl" else [64, 256]  # tiles; merged tokens
    return enable_cuda_graphs(
        model, budgets=budgets, decoder_max_batch_size=2, decoder_max_cache_len=64, choose_by_cost=False
    )


def outputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Greedy tokens of a text prompt and, for Qwen-VL, the image features: what enable routes
    through the graphs (with the weights it rewrote)."""
    ids = torch.arange(2, 14, device="cuda")[None]
    with torch.inference_mode():
        result = [model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)]
        if model.config.model_type.startswith("qwen"):
            generator = torch.Generator(device="cuda").manual_seed(0)
            pixels = random_pixels(model.config.vision_config, GRIDS, generator).to(torch.bfloat16)
            features = model.get_image_features(pixels, torch.tensor(GRIDS, device="cuda")).pooler_output
            result += list(features)
    return result


def assert_kernels_took_the_weights(model: torch.nn.Module, handle) -> None:
    """What enable rewrote on this GPU: stacked projections everywhere, and where the Triton
    kernels run the language model's norms and MLPs (gate and up interleaved); on Qwen2.5-VL the
    window attention, the fused MLPs and the chained blocks too."""
    def shared(first: torch.nn.Module, last: torch.nn.Module) -> bool:
        return first.weight.untyped_storage().data_ptr() == last.weight.untyped_storage().data_ptr()

    layers = model.get_decoder().layers
    layer = next(layer for layer in layers if hasattr(layer, "self_attn"))
    attention = layer.self_attn
    assert shared(attention.q_proj, attention.v_proj)
    if model.config.model_type == "qwen3_5":  # Gated DeltaNet's four input projections; its norms and MLPs are its own
        net = layers[0].linear_attn
        assert shared(net.in_proj_qkv, net.in_proj_a)
        return
    if triton_runs(attention.q_proj.weight.device):
        assert "forward" in layer.input_layernorm.__dict__ and "forward" in layer.post_attention_layernorm.__dict__
        assert "forward" in layer.mlp.__dict__
        assert layer.mlp.gate_proj.weight.stride(0) == 2 * layer.mlp.gate_proj.in_features  # interleaved
    if model.config.model_type == "qwen2_5_vl":
        block = model.model.visual.blocks[0]  # a window block
        assert "forward" in block.attn.__dict__ and "forward" in block.mlp.__dict__
        assert block.mlp.gate_proj.weight.stride(0) == 2 * block.mlp.gate_proj.in_features  # interleaved
        assert handle.adapter._chained_forwards is not None


@pytest.mark.parametrize("mode", ["grad mode", "inference mode"])
@pytest.mark.parametrize("name", FAMILIES)
def test_disable_on_cuda_gives_back_every_parameter_and_the_stock_outputs(name, mode, tmp_path):
    model = cuda_model(name, tmp_path)
    mixed_requires_grad(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    stock = outputs(model)  # also loads what the stock calls register lazily
    before = Snapshot.of(model)
    attention_names = set(ALL_ATTENTION_FUNCTIONS.valid_keys())
    ops = set(torch._C._dispatch_get_all_op_names())
    with torch.inference_mode(mode == "inference mode"):
        handle = enable(model)
        assert_kernels_took_the_weights(model, handle)
        stats = handle.stats()
        assert stats["decoder"]["captured_graphs"] and all(stats["encoder"]["captured_budgets"].values())
        ours = outputs(model)
        state = model.state_dict()
        handle.disable()
    assert handle.stats()["decoder"]["calls"] == 1
    assert ours[0].shape == stock[0].shape
    for key, (_, values, *_) in before.params.items():
        assert torch.equal(state[key], values), f"state_dict()[{key!r}] while enabled is not the stock weight"
    before.assert_same(model)
    assert all(torch.equal(got, want) for got, want in zip(outputs(model), stock, strict=True))
    assert_an_optimizer_made_before_still_trains(model, optimizer)
    assert all(key.startswith("encoder_graphs_") for key in set(ALL_ATTENTION_FUNCTIONS.valid_keys()) - attention_names)
    assert all(op.startswith("encoder_graphs::") for op in set(torch._C._dispatch_get_all_op_names()) - ops)


def test_save_pretrained_while_enabled_on_cuda_writes_the_stock_checkpoint(tmp_path):
    """Qwen2.5-VL with every rewrite on: padded and interleaved MLPs, permuted qkv, stacked
    language model projections. The checkpoint written while enabled loads back as the stock
    model; loading into the rewritten weights refuses."""
    model = cuda_model("tiny-qwen2.5-vl", tmp_path / "stock")
    stock = {key: value.clone() for key, value in model.state_dict().items()}
    handle = enable(model)
    try:
        assert_kernels_took_the_weights(model, handle)
        model.save_pretrained(tmp_path / "enabled")
        with pytest.raises(RuntimeError, match=r"blocks\.0\.attn\.qkv\.weight.*disable\(\)"):
            model.load_state_dict(stock)
    finally:
        handle.disable()
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "enabled", dtype=torch.bfloat16).state_dict()
    assert reloaded.keys() == stock.keys()
    assert all(torch.equal(reloaded[key], value.cpu()) for key, value in stock.items())


FAILURES = {
    # After the encoder graphs were captured over the fused kernels and rewritten weights.
    "decoder capture": (DecoderGraphRunner, "capture", RuntimeError("capture failed")),
    # Inside align_weights, after the window attention and MLPs were fused and q/k/v stacked.
    "align_weights": (qwen2_5_vl, "chains_blocks", RuntimeError("align failed")),
}


@pytest.mark.parametrize("mode", ["grad mode", "inference mode"])
@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_enable_on_cuda_leaves_the_model_as_it_was(failure, mode, monkeypatch, tmp_path):
    model = cuda_model("tiny-qwen2.5-vl", tmp_path)
    mixed_requires_grad(model)
    stock = outputs(model)
    before = Snapshot.of(model)
    owner, name, error = FAILURES[failure]
    raise_at_call(monkeypatch, owner, name, error)
    with torch.inference_mode(mode == "inference mode"), pytest.raises(type(error)):
        enable(model)
    before.assert_same(model)
    assert all(torch.equal(got, want) for got, want in zip(outputs(model), stock, strict=True))
    monkeypatch.undo()
    handle = enable(model)  # enable works again over the same weights
    assert_kernels_took_the_weights(model, handle)
    handle.disable()
    before.assert_same(model)
