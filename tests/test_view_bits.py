"""A saved lazy conjugate / negative view comes back as the same kind of view
(issue 14 #12): its memory is moved as it is and the bit is put back."""

import pytest
import torch

import tiermem


class _Save(torch.autograd.Function):
    """Saves ``v`` and records, in backward, what autograd hands back."""

    got: dict = {}

    @staticmethod
    def forward(ctx, a, v):
        ctx.save_for_backward(v)
        return a * 1

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        _Save.got = {"conj": v.is_conj(), "neg": v.is_neg(), "values": v.resolve_conj().resolve_neg().clone(),
                     "stride": v.stride()}
        return g, None


def _views():
    base = torch.randn(48, 64, dtype=torch.complex64)
    return {"conj": base.conj(), "neg": base._neg_view(), "conj_neg": base.conj()._neg_view(),
            "conj_column": base[:, 3].conj(),          # a gapped view: moved compact
            "conj_transposed": base.t().conj()}


@pytest.mark.parametrize("policy", ["keep", "cpu", "nvme"])
@pytest.mark.parametrize("name", list(_views()))
def test_conj_and_neg_views_are_restored_as_views(tmp_path, policy, name):
    v = _views()[name]
    z = torch.randn(4, requires_grad=True)
    off = tiermem.Offloader(policy=policy, min_offload_bytes=0, nvme_dir=str(tmp_path))
    with off:
        out = _Save.apply(z, v)
    if policy != "keep":
        assert off.stats.count_by_tier[policy] == 1
    out.sum().backward()
    got = _Save.got
    assert (got["conj"], got["neg"]) == (v.is_conj(), v.is_neg())
    assert torch.equal(got["values"], v.resolve_conj().resolve_neg())
    off.close()


def _columns():
    base = torch.randn(48, 64, dtype=torch.complex64)
    return {"conj": base[:, 3].conj(), "neg": base[:, 5]._neg_view(),
            "conj_neg": base[:, 7].conj()._neg_view()}


@pytest.mark.parametrize("name", list(_columns()))
def test_a_dense_copy_keeps_the_bits(name):
    """What backward gets for a gapped (compact) view whose move has not
    landed yet (the original, made dense): the same values and the same
    conj/neg bits as the restore would give."""
    from tiermem.tiers.base import Layout

    v = _columns()[name]
    layout = Layout.of(v)
    assert layout.compact
    d = layout.dense(v)
    assert (d.is_conj(), d.is_neg()) == (v.is_conj(), v.is_neg())
    assert torch.equal(d.resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg())
    assert d.is_contiguous()
