"""Attention kernels over the paged KV cache (installed as `radixserve.kernels`).

`reference` holds plain torch versions: the CPU path and the ground truth for the Triton
kernels, which live beside them and run on CUDA or under `TRITON_INTERPRET=1`.
"""
