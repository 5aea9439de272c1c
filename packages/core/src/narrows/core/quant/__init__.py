"""Quantisation: NF4 through bitsandbytes, and 4-bit weights held dequantised."""
