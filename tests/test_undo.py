"""A clean undo (`encoder_graphs/rewrites/`), on the CPU: after `enable_cuda_graphs` then `disable()`, and
after an enable that fails at any point, the model is as it was: every parameter the same object
with the same values, `requires_grad`, kind (inference tensor or not) and strides, no instance
attribute or hook of ours left on any module, the configs' attention implementations unchanged.
While enabled, `state_dict()` (so `save_pretrained`) gives the stock weights and `load_state_dict`
refuses. On the CPU, enable pads Qwen2.5-VL's vision MLPs, runs the patch embedding as a GEMM,
stacks the language model's q/k/v and gate/up projections (the decoder runner) and, with
`compile=True`, compiles blocks in place; tests/test_enable_gpu.py covers the GPU-only rewrites
(window attention, fused MLP, chained blocks). Tiny models, fp32, saved and reloaded for real."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tiny_internvl import write_tiny_internvl
from torch import nn
from transformers import AutoModelForImageTextToText
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import encoder_graphs.decoder.layers.decode as text_decode
import encoder_graphs.models.qwen.qwen2_5_vl as qwen2_5_vl
from encoder_graphs import DecoderGraphRunner, EncoderCudaGraphManager, enable_cuda_graphs
from encoder_graphs.presets import build_model

FAMILIES = ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-internvl"]
TABLES = ("_parameters", "_buffers", "_modules")  # compared entry by entry, not as objects


def load(name: str, directory) -> nn.Module:
    """A tiny model of family `name`, written and read back as a checkpoint."""
    if name == "tiny-internvl":
        write_tiny_internvl(directory)
    else:
        build_model(name, seed=5).save_pretrained(directory)
    return AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    return load(request.param, tmp_path_factory.mktemp(request.param))


def enable(model: nn.Module, **kwargs) -> Any:
    return enable_cuda_graphs(model, budgets=[4, 64], decoder_max_batch_size=2, decoder_max_cache_len=64, **kwargs)


@dataclass
class Snapshot:
    """What a model is, as far as enable and disable could change it."""

    params: dict[str, tuple[nn.Parameter, torch.Tensor, bool, bool, tuple[int, ...]]]
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    attributes: dict[str, dict[str, Any]]  # per module, its instance attributes (hook tables copied)
    attention: list[str | None]  # each config's attention implementation

    @classmethod
    def of(cls, model: nn.Module) -> "Snapshot":
        return cls(
            params={
                name: (p, p.detach().clone(), p.requires_grad, p.is_inference(), p.stride())
                for name, p in model.named_parameters(remove_duplicate=False)
            },
            buffers={name: (b, b.clone()) for name, b in model.named_buffers(remove_duplicate=False)},
            attributes={name: _attributes(module) for name, module in model.named_modules(remove_duplicate=False)},
            attention=_attention_implementations(model),
        )

    def assert_same(self, model: nn.Module) -> None:
        after = Snapshot.of(model)
        assert after.params.keys() == self.params.keys()
        for name, (param, values, grad, inference, stride) in self.params.items():
            now = after.params[name]
            assert now[0] is param, f"{name} is another Parameter object"
            assert torch.equal(now[1], values) and now[1].dtype == values.dtype, f"{name} changed values"
            assert now[2:] == (grad, inference, stride), f"{name}: requires_grad, kind, strides {now[2:]}"
        assert after.buffers.keys() == self.buffers.keys()
        for name, (buffer, values) in self.buffers.items():
            assert after.buffers[name][0] is buffer and torch.equal(buffer, values), name
        assert after.attributes.keys() == self.attributes.keys()
        for name, attributes in self.attributes.items():
            now = after.attributes[name]
            assert now.keys() == attributes.keys(), f"{name!r}: {now.keys() ^ attributes.keys()} left or gone"
            for key, value in attributes.items():
                assert _same(now[key], value), f"{name!r}.{key}: {value!r} -> {now[key]!r}"
        assert after.attention == self.attention


def _attributes(module: nn.Module) -> dict[str, Any]:
    """Instance attributes (a patched forward, a width, compiled code land here), hook tables copied."""
    return {key: dict(value) if isinstance(value, dict) else value for key, value in vars(module).items()
            if key not in TABLES}


def _same(now: Any, before: Any) -> bool:
    if isinstance(now, torch.Tensor) and isinstance(before, torch.Tensor):  # a forward's cache, e.g. rope_deltas
        return now.shape == before.shape and torch.equal(now, before)
    return now is before or now == before


def _attention_implementations(model: nn.Module) -> list[str | None]:
    configs = [model.config, *(getattr(model.config, key, None) for key in ("vision_config", "text_config"))]
    return [config._attn_implementation for config in configs if config is not None]


def mixed_requires_grad(model: nn.Module) -> None:
    """Every other parameter frozen: disable() must keep each one's own flag."""
    for index, param in enumerate(model.parameters()):
        param.requires_grad_(index % 2 == 0)


def assert_an_optimizer_made_before_still_trains(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A step of an optimizer made before enable reaches the model's weights (the same objects,
    ordinary tensors that take an in-place update)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    for param in trained:
        param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(p, b - 1) for p, b in zip(trained, before, strict=True))
    with torch.no_grad():
        for param, values in zip(trained, before, strict=True):
            param.copy_(values)


@pytest.mark.parametrize("mode", ["grad mode", "inference mode"])
def test_disable_gives_back_every_parameter_as_it_was(model, mode):
    mixed_requires_grad(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = Snapshot.of(model)
    with torch.inference_mode(mode == "inference mode"):
        handle = enable(model)
        assert handle.decoder is not None
        if model.config.model_type != "qwen3_5":  # Gated DeltaNet layers: the model's own forward
            attention = model.get_decoder().layers[0].self_attn
            q, k = attention.q_proj.weight, attention.k_proj.weight
            assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr(), "q/k/v stacked on the CPU too"
        if model.config.model_type == "qwen2_5_vl":
            assert model.model.visual.blocks[0].mlp.down_proj.in_features % 8 == 0, "padded on the CPU too"
        handle.disable()
    before.assert_same(model)
    assert_an_optimizer_made_before_still_trains(model, optimizer)
    handle.disable()  # a second disable undoes nothing twice
    before.assert_same(model)
    for param in model.parameters():
        param.requires_grad_(True)


def test_every_attention_function_we_register_has_our_name(model):
    """What stays registered after disable(): transformers' attention table holds our functions
    only under `encoder_graphs_*` names, which no stock config names (see enable.py)."""
    enable(model).disable()
    ours = [
        name for name in ALL_ATTENTION_FUNCTIONS.valid_keys()
        if getattr(ALL_ATTENTION_FUNCTIONS[name], "__module__", "").startswith("encoder_graphs")
    ]
    assert ours and all(name.startswith("encoder_graphs_") for name in ours), ours
    assert not any(name.startswith("encoder_graphs") for name in _attention_implementations(model))


def test_state_dict_while_enabled_is_stock_and_saves_a_stock_checkpoint(tmp_path):
    """Qwen2.5-VL: vision MLPs padded (44 -> 48), language model projections stacked. The state
    dict has the stock shapes and values in tensors of their own (safetensors refuses shared
    ones); the saved checkpoint loads back as the stock model; loading into the changed weights
    refuses, naming them."""
    model = load("tiny-qwen2.5-vl", tmp_path / "stock")
    stock = {key: value.clone() for key, value in model.state_dict().items()}
    before = Snapshot.of(model)
    handle = enable(model)
    try:
        mlp = model.model.visual.blocks[0].mlp
        assert mlp.gate_proj.weight.shape[0] != stock["model.visual.blocks.0.mlp.gate_proj.weight"].shape[0]
        state = model.state_dict()
        assert state.keys() == stock.keys()
        for key, value in stock.items():
            assert state[key].shape == value.shape and torch.equal(state[key], value), key
        attention = "model.language_model.layers.0.self_attn."
        storages = {state[attention + f"{p}_proj.weight"].untyped_storage().data_ptr() for p in "qkv"}
        assert len(storages) == 3
        model.save_pretrained(tmp_path / "enabled")
        with pytest.raises(RuntimeError, match=r"blocks\.0\.mlp\.gate_proj\.weight.*disable\(\)"):
            model.load_state_dict(stock)
    finally:
        handle.disable()
    before.assert_same(model)
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "enabled", dtype=torch.float32)
    assert all(torch.equal(reloaded.state_dict()[key], value) for key, value in stock.items())
    model.load_state_dict(stock)  # after disable the stock weights load again
    before.assert_same(model)


def raise_at_call(monkeypatch, owner: Any, name: str, error: BaseException, call: int = 1) -> None:
    """`owner.name` (our own code) raises `error` at its `call`-th call, running as before until then."""
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


FAILURES = {
    # After every rewrite (patch embed, MLP padding, stacked projections), before the handle exists.
    "encoder capture": (EncoderCudaGraphManager, "capture", RuntimeError("capture failed"), 1, {}),
    "decoder capture": (DecoderGraphRunner, "capture", RuntimeError("capture failed"), 1, {}),
    # Inside align_weights, after the decoder runner stacked q/k/v and the MLPs were padded.
    "align_weights": (qwen2_5_vl, "chains_blocks", RuntimeError("align failed"), 1, {}),
    # The decoder runner, midway through stacking its layers (the second layer's gate/up).
    "stacking": (text_decode, "StackedLinear", RuntimeError("stacking failed"), 4, {}),
    # Ctrl-C in torch.compile's warm-up (a compiler failure only warns; an interrupt goes on).
    "compile warm-up": (EncoderCudaGraphManager, "warm_up", KeyboardInterrupt(), 1, {"compile": True}),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_enable_leaves_the_model_as_it_was(failure, monkeypatch, tmp_path):
    model = load("tiny-qwen2.5-vl", tmp_path)
    mixed_requires_grad(model)
    before = Snapshot.of(model)
    owner, name, error, call, options = FAILURES[failure]
    raise_at_call(monkeypatch, owner, name, error, call)
    with pytest.raises(type(error)):
        enable(model, **options)
    before.assert_same(model)
    monkeypatch.undo()
    enable(model).disable()  # enable works again, and undoes again
    before.assert_same(model)


def test_the_gpu_rewrites_composed_on_the_cpu_show_and_give_back_the_stock_weights():
    """What enable does to Qwen2.5-VL's vision blocks on a GPU, with plain-torch stand-ins for the
    kernels: MLPs padded then interleaved (two changes of one parameter, undone in order), window
    attention's q/k dims permuted. The tower's output is unchanged, `state_dict()` is the stock
    one meanwhile, and the undo gives back every parameter as it was."""
    from test_aligned_mlp import interleaved_reference

    from encoder_graphs.models.qwen.aligned_mlp import align_gated_mlps
    from encoder_graphs.models.qwen.qwen2_5_vl import interleave_pairs
    from encoder_graphs.presets import build_vision_tower
    from encoder_graphs.rewrites import Rewrites
    from encoder_graphs.rewrites.fused_mlp import fuse_gated_mlp
    from encoder_graphs.seam.vision import permute_qk

    tower = build_vision_tower("tiny-qwen2.5-vl", seed=1)
    mixed_requires_grad(tower)
    grid = torch.tensor([[1, 8, 12]])
    pixels = torch.randn(96, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    stock = {key: value.clone() for key, value in tower.state_dict().items()}
    before = Snapshot.of(tower)
    rewrites = Rewrites()
    with torch.inference_mode():
        reference = tower(pixels, grid_thw=grid).pooler_output
        align_gated_mlps([block.mlp for block in tower.blocks], rewrites)
        for block in tower.blocks:
            fuse_gated_mlp(block.mlp, interleaved_reference, rewrites)
        attention, mlp = tower.blocks[0].attn, tower.blocks[0].mlp
        permute_qk(attention, interleave_pairs(attention.head_dim), rewrites)  # its forward left stock
        gate = mlp.gate_proj.weight
        assert gate.shape[0] % 8 == 0 and gate.stride(0) == 2 * mlp.gate_proj.in_features  # padded, interleaved
        state = tower.state_dict()
        assert all(state[key].shape == value.shape and torch.equal(state[key], value) for key, value in stock.items())
        assert not torch.equal(attention.qkv.weight, stock["blocks.0.attn.qkv.weight"])  # permuted
        rewrites.undo()
    before.assert_same(tower)
    with torch.inference_mode():
        torch.testing.assert_close(tower(pixels, grid_thw=grid).pooler_output, reference, rtol=0, atol=0)
