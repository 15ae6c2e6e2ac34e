"""A run's folder: the iteration layout, the commit protocol, the pointer and retention.

What makes an iteration committed and loadable, and what may be deleted. Imports the storage
layer only; torch is imported by nothing here.
"""
