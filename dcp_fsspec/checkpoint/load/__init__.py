"""One load: decide what to read, check every key before any is applied, read, agree.

Imports ``checkpoint.commit`` and the storage layer.
"""
