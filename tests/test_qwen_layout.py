from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_graphs.models import Qwen2_5_VLAdapter
from encoder_graphs.presets import build_vision_tower

ADAPTER = Qwen2_5_VLAdapter(build_vision_tower("tiny-qwen2.5-vl"))


@settings(max_examples=80, deadline=None)
@given(
    strips=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 40)), min_size=1, max_size=16),
    budget=st.sampled_from([64, 181, 512]),
    max_frames=st.sampled_from([8, 16, 32]),
)
def test_window_layout_holds_any_sub_batch_within_its_caps(strips, budget, max_frames):
    """Thin strips of odd length maximise windows per token; every sub-batch the packer can form
    (tokens <= budget, frames <= max_frames) must fit the padded window layout."""
    grids, tokens, frames = [], 0, 0
    for t, length in strips:
        if tokens + t * length > budget or frames + t > max_frames:
            break
        grids.append((t, 2, 2 * length))  # t frames of 1 x length merged tokens
        tokens, frames = tokens + t * length, frames + t
    layout = ADAPTER.layout(budget, max_frames)
    tensors, _ = ADAPTER.metadata(grids, layout)
    offsets = tensors["cu_window_seqlens"]
    assert offsets.numel() == layout.windows + 1
    assert int(offsets[-1]) == layout.rows
    assert bool((offsets.diff() >= 0).all()) and int(offsets.diff().max()) <= ADAPTER.window_rows
    assert layout.windows < budget + layout.rows // ADAPTER.window_rows  # tighter than one per token
