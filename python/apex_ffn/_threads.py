"""Threads of the operations: torch.get_num_threads() unless set here. The setting lives in the extension,
which reads it itself in the module's inference call (PackedExperts.infer)."""
from . import _core


def check_threads(where, n):
    """ValueError unless `n` is None or a thread count the extension takes (an int from 1 to 2**31 - 1)."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < 2**31):
        raise ValueError(f"{where}: expected a positive int or None, got {n!r}")


def set_num_threads(n):
    """Runs the operations on `n` threads (None: follow torch.get_num_threads())."""
    check_threads("apex_ffn.set_num_threads", n)
    _core.set_num_threads(n)


def get_num_threads():
    """The threads the operations run on."""
    return _core.get_num_threads()
