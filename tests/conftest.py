"""Session set-up shared by the test files."""
import os

# Triton reads TRITON_INTERPRET when triton.language is first imported, and only then builds its library for
# the interpreter that runs the DSA kernels on CPU tensors (tests/test_dsa_triton.py). Import it here, in
# that mode, before any test module can import it otherwise; then clear the variable, so that nothing else
# dispatches to the (slow) interpreter unless a test asks for it.
_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton.language  # noqa: F401
except ImportError:  # no triton: the kernel tests skip
    pass
if _previous is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _previous
