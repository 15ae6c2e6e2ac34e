"""Benchmarks: dcp_fsspec side by side with torch's DCP storage and s3torchconnector.

``python -m benchmarks.run`` is the entry point (see benchmarks/README.md). The pieces, bottom
up: ``state`` (a deterministic checkpoint-shaped state dict), ``s3server`` (moto behind a
counting, range-serving WSGI layer), ``impls`` (the writers/readers under test), ``worker``
(one measured save, load or ceiling in a fresh process, one JSON line), ``report`` (medians,
ratios, targets, markdown) and ``run`` (starts the servers and alternates the workers).
"""
