"""Attention backends: the interface the model calls (`base`), the backends (`torch_backend`,
`triton_backend`), tree attention's shared pieces (`cascade_split`, `triton_cascade`), and
the table that makes one by name (`registry`)."""
