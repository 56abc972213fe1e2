"""Tensors as the extension takes them, made with as few calls into torch as can be."""
import torch


def float32(t):
    """t as contiguous float32; t itself when it is, without a call into torch's dispatcher (at decode,
    after a step has left the interpreter's caches cold, each such call costs microseconds)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() and not t.is_neg() else plain(t.float())


def int64(t):
    return t if t.dtype == torch.int64 and t.is_contiguous() and not t.is_neg() else plain(t.long())


def plain(t):
    """t contiguous with its negative bit resolved: DLPack hands over a lazily negated view's memory as it
    is, un-negated (such views come from e.g. z.conj().imag)."""
    return t.resolve_neg().contiguous()
