"""Kernels: the fast decoder layer (its ops each beside a reference) and PEFT's LoRA branches fused into one autograd node."""
