"""Threads of the operations: torch.get_num_threads() unless set here."""
import torch

_threads = None


def set_num_threads(n):
    """Runs the operations on `n` threads (None: follow torch.get_num_threads())."""
    global _threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"apex_ffn.set_num_threads: expected a positive int or None, got {n!r}")
    _threads = n


def get_num_threads():
    return _threads if _threads is not None else torch.get_num_threads()
