"""CUDA graph capture and tiermem (NOTE [CUDA graph capture] in
tiermem/runtime/hooks.py): entering an Offloader while the current stream captures
is a clear TierMemError; a capture begun inside a step keeps the tensors it
saves where they are."""

import pytest
import torch

import tiermem
from helpers import offloader


def test_entering_while_a_graph_is_captured_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    off = offloader("cpu")
    with pytest.raises(tiermem.TierMemError, match="capturing a CUDA graph"):
        with off:
            pass
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with off:   # not left half-entered
        pass
    off.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_capture_begun_inside_a_step_keeps_its_saved_tensors():
    dev = torch.device("cuda")
    lin = torch.nn.Linear(256, 256).to(dev)
    x = torch.randn(64, 256, device=dev, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up (cuBLAS handles) off the capture
        lin(x).relu().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    off = offloader("cpu")
    with off:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lin(x).relu()
    torch.cuda.synchronize()
    assert off.stats.count_by_tier["cpu"] == 0, off.stats
    assert off.stats.unsupported_count >= 1, off.stats
    del y, graph
    off.close()
