import torch

from encoder_graphs import enable_cuda_graphs
from encoder_graphs.models import Qwen2_5_VLAdapter, VisionBatch
from encoder_graphs.models.presets import build_model, build_vision_tower, get_config


def test_aligned_mlp_is_exact_and_restorable():
    tower = build_vision_tower("tiny-qwen2.5-vl")
    width = tower.blocks[0].mlp.down_proj.in_features
    assert width % 8, "the tiny preset keeps Qwen2.5-VL's misaligned MLP width"
    assert get_config("qwen2.5-vl-7b").vision_config.intermediate_size == 3420
    before = {k: v.clone() for k, v in tower.state_dict().items()}
    adapter = Qwen2_5_VLAdapter(tower)
    grid = torch.tensor([[1, 8, 12]])
    batch = VisionBatch(pixel_values=torch.randn(96, 3 * 2 * 14 * 14), image_grid_thw=grid)
    with torch.inference_mode():
        reference = adapter.eager_forward(batch, "default")["embeds"]
        adapter.align_weights()
        adapter.align_weights()  # idempotent
        mlp = tower.blocks[0].mlp
        assert mlp.gate_proj.weight.shape[0] % 8 == 0 == mlp.down_proj.weight.shape[1] % 8
        assert mlp.up_proj.out_features == mlp.down_proj.in_features == mlp.gate_proj.weight.shape[0]
        aligned = adapter.eager_forward(batch, "default")["embeds"]
        adapter.restore_weights()
    torch.testing.assert_close(aligned, reference, rtol=1e-5, atol=1e-6)
    after = tower.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_enable_aligns_and_disable_restores_the_weights():
    model = build_model("tiny-qwen2.5-vl")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = enable_cuda_graphs(model, decoder=False)
    assert model.model.visual.blocks[0].mlp.down_proj.in_features % 8 == 0
    handle.disable()
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
