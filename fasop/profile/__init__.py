"""Layer-time profiles and link bandwidths: synthesised from FLOPs and bytes, or measured with PyTorch."""
