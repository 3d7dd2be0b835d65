"""attnzoo's fused GPU kernels, written in Triton (the ``cuda`` backend). None yet."""
