"""Tiermem's hooks hidden from torch.compile (:func:`opaque`)."""

from __future__ import annotations

__all__ = ["opaque", "hidden_hook"]


def _frame_switch():
    """Dynamo's frame-evaluation switch and its code-skipping call, or ``None``
    (a torch without them: :func:`opaque` uses ``torch._dynamo.disable``)."""
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
        from torch._dynamo.eval_frame import skip_code
    except Exception:
        return None
    return set_eval_frame, skip_code


_SWITCH: list = []   # [the switch or None], resolved at the first opaque() (imports Dynamo)


def opaque(fn):
    """``fn`` hidden from torch.compile.

    # NOTE [Hooks under torch.compile]
    # Recent PyTorch traces the active saved-tensor hooks into a compiled
    # graph (AOTAutograd); ours are Python bookkeeping, not graph code, and
    # tracing them fails (BackendCompilerFailed on `_is_param`). Hidden from
    # Dynamo they run eagerly when the compiled function saves its tensors, as
    # PyTorch did before. Hidden as ``torch._dynamo.disable`` hides a function
    # (frame evaluation off while it runs, its own frame never compiled, marked
    # disabled), in two C calls per call: the pack hook runs per saved tensor.
    """
    if not _SWITCH:
        _SWITCH.append(_frame_switch())
        if _SWITCH[0] is not None:   # every closure of opaque shares one code object
            _SWITCH[0][1](_hide(_SWITCH[0][0], None).__code__)
    if _SWITCH[0] is None:
        try:
            import torch._dynamo
            return torch._dynamo.disable(fn)
        except Exception:   # a torch without Dynamo: nothing to hide from
            return fn
    return _hide(_SWITCH[0][0], fn)


def _hide(set_eval_frame, fn):
    """``fn`` run with frame evaluation off: NOTE [Hooks under torch.compile]."""
    def hidden(*args):
        prior = set_eval_frame(None)
        try:
            return fn(*args)
        finally:
            set_eval_frame(prior)

    hidden._torchdynamo_disable = True
    hidden._torchdynamo_orig_callable = fn
    return hidden


_opaque_hooks: dict = {}


def hidden_hook(name: str, fn):
    """``fn`` hidden from torch.compile, made once per process (under ``name``)."""
    hook = _opaque_hooks.get(name)
    if hook is None:
        hook = _opaque_hooks[name] = opaque(fn)
    return hook
