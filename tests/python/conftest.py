"""The Python tests need torch and the built extension; each skips with a
message when something it needs is absent."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

torch = pytest.importorskip("torch", reason="torch is not installed: the apex_ffn Python tests need it")
apex_ffn = pytest.importorskip("apex_ffn", reason="the apex_ffn extension is not built or not on PYTHONPATH")
