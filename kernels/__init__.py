"""Attention and cache kernels: Triton on CUDA, plain torch (reference.py) on
CPU. Models call the functions in ``ops``, the one dispatch point."""
