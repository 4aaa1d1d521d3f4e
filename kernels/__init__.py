"""Attention and cache kernels: Triton on CUDA, plain torch (reference.py) or
the CPU kernels (cpu_attention.py) elsewhere. Models call the functions in
``ops``, the one dispatch point, which also reads the kernel switch
``FLUIDSERVE_KERNELS``.

Triton decides when it is imported whether its functions are interpreted,
so ``FLUIDSERVE_KERNELS=triton`` on a machine without CUDA turns the
interpreter on here, before anything of ours imports Triton."""

import os as _os

if (_os.environ.get("FLUIDSERVE_KERNELS", "").strip().lower() == "triton"
        and "TRITON_INTERPRET" not in _os.environ):
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"
