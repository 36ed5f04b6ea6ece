import pytest
import torch
from toy_vit import ToyViT

from encoder_graphs import EncoderCudaGraphManager
from encoder_graphs.protocols import (
    PROTOCOL_METHODS,
    EncoderCudaGraphConfig,
    EncoderItemSpec,
    EncoderPathConfig,
    SupportsEncoderCudaGraph,
)


class HalfModel:
    def get_encoder_cudagraph_config(self):
        return EncoderCudaGraphConfig()

    def get_budget_range(self):
        return {"default": (64, 128)}


def test_toy_vit_satisfies_protocol():
    assert isinstance(ToyViT(), SupportsEncoderCudaGraph)
    assert set(PROTOCOL_METHODS) >= {"graph_forward", "eager_forward", "prepare_replay_buffers"}


def test_missing_methods_are_listed_at_wrap_time():
    with pytest.raises(TypeError) as error:
        EncoderCudaGraphManager(HalfModel())
    message = str(error.value)
    assert "HalfModel" in message
    for name in ("get_item_specs", "select_items", "graph_forward", "postprocess"):
        assert name in message
    assert "get_budget_range" not in message


def test_dataclasses_validate():
    with pytest.raises(ValueError):
        EncoderItemSpec(input_size=4, output_tokens=1, frames=0)
    with pytest.raises(ValueError):
        EncoderItemSpec(input_size=4, output_tokens=1, path_tokens={"a": -1})
    with pytest.raises(ValueError):
        EncoderPathConfig(name="")
    with pytest.raises(ValueError):
        EncoderCudaGraphConfig(paths=(EncoderPathConfig("a"), EncoderPathConfig("a")))
    with pytest.raises(ValueError):
        EncoderCudaGraphConfig(paths=())
    assert EncoderCudaGraphConfig(dtype=torch.bfloat16).path_names == ["default"]
