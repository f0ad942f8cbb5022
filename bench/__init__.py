"""Benchmarks and the GPU cost model, outside the runtime package (nothing in ``backend/`` imports them).

    python -m bench lora|batch|quant ...    the measured benchmarks (bench/__main__.py)
    python -m bench.distill                 distill fuse / restore against reloading
    python -m bench.costmodel               the modelled switch cost on a GPU (bench/costmodel.py)

``bench/kit.py`` is the shared harness: rotated rounds, medians with min-max, the load average.
"""
