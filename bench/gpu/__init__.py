"""The GPU run in one place: `python bench/gpu/run.py --out $OUT` runs the CUDA tests, then
times the kernels (kernels.py), the engine (engine.py) and the GPU step (step.py)."""
