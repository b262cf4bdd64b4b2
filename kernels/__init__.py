"""GPU kernels, the floor of the house: the DSA Triton kernels and the engine's fused sampler (dsa_triton.py).
dsa.py and the engine call them; they import no chapter and nothing of machinery/, only torch and triton."""
