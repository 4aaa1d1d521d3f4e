"""Attention and cache kernels: Triton on CUDA, plain torch (reference.py) or
the CPU kernels (cpu_attention.py) elsewhere. Models call the functions in
``ops``, the one dispatch point, which also reads the kernel switch
``FLUIDSERVE_KERNELS``.

Triton decides when it is imported whether its functions are interpreted,
so ``FLUIDSERVE_KERNELS=triton`` on a machine without CUDA turns the
interpreter on here, before anything of ours imports Triton.

This folder is also reachable as a top-level ``kernels`` wherever the
checkout's root is on ``sys.path`` (``python -m pytest`` or ``python -c``
run from it), where it would hide PyPI's ``kernels``, which transformers
imports as soon as that is installed. Imported under that name, it puts
PyPI's package in its place (a module may replace itself in
``sys.modules``; the import returns what is there when it finishes)."""

import sys as _sys

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    from pathlib import Path as _Path

    _root = _Path(__file__).resolve().parent.parent
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _Path(p or ".").resolve() != _root])
    if _spec is None:
        raise ModuleNotFoundError(f"No module named 'kernels' outside {_root} (fluidserve's kernels are "
                                  "fluidserve.kernels)", name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
    del _module, _spec, _root
else:
    import os as _os

    if (_os.environ.get("FLUIDSERVE_KERNELS", "").strip().lower() == "triton"
            and "TRITON_INTERPRET" not in _os.environ):
        import torch as _torch

        if not _torch.cuda.is_available():
            _os.environ["TRITON_INTERPRET"] = "1"
