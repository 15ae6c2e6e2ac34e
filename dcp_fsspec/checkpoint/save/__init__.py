"""One save after the state is staged: write every key, commit, apply retention.

In the training process, or in the background process of an asynchronous save. Imports
``checkpoint.commit`` and the storage layer.
"""
