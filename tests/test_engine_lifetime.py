"""I/O engines are shared by the nvme stores that use them and end with the
last one (issue 14 #6); io_threads is bounded."""

import psutil
import pytest
import torch

import tiermem
import tiermem.testing
from tiermem.config import MAX_IO_THREADS


def _threads() -> int:
    return psutil.Process().num_threads()


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_closed_offloaders_leave_no_engine_threads(tmp_path, engine):
    if engine == "cpp" and tiermem.engine_info("cpp")["engine"] != "cpp":
        pytest.skip("C++ engine unavailable")
    x = torch.randn(1 << 12, requires_grad=True)
    baseline = _threads()
    offs = [tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path), engine=engine,
                              io_threads=n, min_offload_bytes=0) for n in range(5, 10)]
    before_close = _threads()
    for off in offs:
        with off:
            y = x.sin().cos()
        y.sum().backward()
    for off in offs:
        off.close()
    after = _threads()
    # 5 + 6 + 7 + 8 + 9 = 35 engine threads at least, and all of them end.
    assert before_close - baseline >= 35 and after <= baseline + 2, (baseline, before_close, after)


def test_offloaders_with_the_same_engine_share_it_until_the_last_closes(tmp_path):
    a = tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path), engine="python", io_threads=11)
    b = tiermem.Offloader(policy="nvme", nvme_dir=str(tmp_path), engine="python", io_threads=11)
    engine = tiermem.testing.store_of(a, tiermem.Tier.NVME).engine
    assert tiermem.testing.store_of(b, tiermem.Tier.NVME).engine is engine
    a.close()
    assert not engine.closed
    b.close()
    assert engine.closed


@pytest.mark.parametrize("value", [0, MAX_IO_THREADS + 1, 5000, 2**31])
def test_io_threads_out_of_range_is_a_config_error(monkeypatch, value):
    with pytest.raises(tiermem.ConfigError, match="io_threads"):
        tiermem.Config.from_env(io_threads=value)
    monkeypatch.setenv("TIERMEM_IO_THREADS", str(value))
    with pytest.raises(tiermem.ConfigError, match="TIERMEM_IO_THREADS"):
        tiermem.Config.from_env()
