"""The graph cache's bookkeeping, which the encoder manager and the decoder runner share, on the
CPU: a recording stand-in replaces the CUDA session (the logic, not CUDA); the captures
themselves are checked on the GPU (test_manager_gpu.py, test_decoder_gpu.py)."""

from contextlib import contextmanager

import pytest
import torch

from encoder_graphs.engine.capture import GraphCache


class RecordingCache(GraphCache):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), "test")
        self.sessions = 0

    @contextmanager
    def session(self):
        self.sessions += 1
        yield


def make(fail: dict):
    made = []

    def build(key):
        made.append(key)
        if key in fail:
            raise fail[key]
        return f"graph {key}"

    return made, build


def test_keys_are_captured_in_the_order_given_and_never_twice():
    cache, (made, build) = RecordingCache(), make({})
    assert cache.capture([("a", 64), ("a", 16)], build, str) == [("a", 64), ("a", 16)]
    assert cache.capture([("a", 64), ("b", 32), ("a", 16)], build, str) == [("b", 32)]
    assert made == [("a", 64), ("a", 16), ("b", 32)]
    assert cache.graphs == {("a", 64): "graph ('a', 64)", ("a", 16): "graph ('a', 16)", ("b", 32): "graph ('b', 32)"}
    assert cache.sessions == 2
    assert cache.capture([("a", 16)], build, str) == [] and cache.sessions == 2  # nothing new: no session


def test_a_capture_failure_is_remembered_loudly_and_not_tried_again():
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    cache, (made, build) = RecordingCache(), make({(4, 128): oom})
    with pytest.warns(UserWarning, match=r"test graph capture failed for batch 4; it runs eagerly: CUDA out of memory"):
        assert cache.capture([(4, 256), (4, 128), (4, 64)], build, lambda key: f"batch {key[0]}") == [(4, 256), (4, 64)]
    assert cache.failed == {(4, 128): "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert cache.tried((4, 128)) and (4, 128) not in cache.graphs
    assert cache.capture([(4, 128)], build, str) == [] and made.count((4, 128)) == 1
    cache.clear()
    assert cache.graphs == {} and cache.pool is None and cache.tried((4, 128))  # the failure stays known
    cache.clear(forget_failures=True)
    assert not cache.tried((4, 128))


def test_an_error_that_is_no_capture_failure_is_a_bug_and_propagates():
    cache, (_, build) = RecordingCache(), make({("a", 8): ValueError("capture inputs of the wrong size")})
    with pytest.raises(ValueError, match="wrong size"):
        cache.capture([("a", 8)], build, str)
    assert not cache.tried(("a", 8))
