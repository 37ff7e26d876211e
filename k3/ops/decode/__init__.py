"""Fused one-token decode kernels: a decoder layer's mixer, FFN, router and experts, each in one native call.

The kernels take tensors only (k3.model.fused gathers them from the model's modules); see ``_native.cpp``.
"""
