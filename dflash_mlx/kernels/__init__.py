"""Kernels: the Metal launches (metal.py), the fused CPU forms of norms, RoPE and attention
(fused_ops.py), and the C++ softmax built for this machine (cpu.py)."""
