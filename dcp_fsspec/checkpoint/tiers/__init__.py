"""Two tiers: every save commits on a local tier first; a drain copies it to the durable one.

Imports ``checkpoint.commit``, ``checkpoint.save`` and the storage layer.
"""
