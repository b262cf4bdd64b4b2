"""Session set-up shared by the test files."""
import os

# No test ever reaches the network: huggingface_hub (read at its import) and transformers look in the local cache
# only. Tests of Hub ids (tests/test_hub.py) lay out a cache of their own, as the Hub's.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"

# Triton reads TRITON_INTERPRET when triton.language is first imported, and only then builds its library for
# the interpreter that runs the DSA kernels on CPU tensors (tests/test_dsa_triton.py). Import it here, in
# that mode, before any test module can import it otherwise; then clear the variable, so that nothing else
# dispatches to the (slow) interpreter unless a test asks for it. TRITON_INTERPRET=0, set by the caller
# (bench/gpu.sh's GPU-only tests): no interpreter at all, so kernels compile for the GPU in this session (a
# session that imported triton in interpreter mode cannot compile: triton 3.6 asserts at the first launch);
# tests/test_dsa_triton.py then skips, and its sm_90 compile test runs in a session of its own.
_previous = os.environ.get("TRITON_INTERPRET")
if _previous != "0":
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # no triton: the kernel tests skip
        pass
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous


def compile_for_h100(script):
    """Run a script that compiles Triton kernels for sm_90 with Triton's compiler and ptxas (no GPU needed), in
    a fresh process: this one's triton was imported in interpreter mode. Skips without the NVIDIA backend or
    ptxas; returns the finished process (its stdout is the script's report)."""
    import subprocess
    import sys

    import pytest
    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, env=env)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip("no ptxas in this triton install")
    assert r.returncode == 0, r.stderr[-3000:]
    return r


class CudaAutocastFP32Ops:
    """CUDA autocast's float32 ops on a CPU: under torch.autocast("cpu") each of these returns fp32, as CUDA's autocast
    policy runs them (sum, softmax, exp, pow, ... in fp32; the CPU's list is shorter). A model that is bf16 under the
    CPU's autocast but turns fp32 on a GPU shows it here. Use as a context manager (a TorchFunctionMode)."""
    OPS = ("sum", "prod", "cumsum", "cumprod", "softmax", "log_softmax", "exp", "log", "pow", "rsqrt", "norm")

    def __init__(self):
        import torch
        from torch.overrides import TorchFunctionMode

        names = self.OPS
        funcs = {f for n in names for f in (getattr(torch, n, None), getattr(torch.Tensor, n, None),
                                            getattr(torch.nn.functional, n, None)) if f is not None}
        funcs |= {torch.Tensor.__pow__}

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if (func in funcs and torch.is_autocast_enabled("cpu") and isinstance(out, torch.Tensor)
                        and out.dtype in (torch.bfloat16, torch.float16)):
                    return out.float()
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
