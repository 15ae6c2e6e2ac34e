"""The storage layer: DCP StorageWriter/StorageReader for any fsspec filesystem.

Sub-packages, bottom up: ``transport`` (URLs, retries, error wrapping, threads), ``backends``
(the contract every store implements), ``format`` (the bytes: torch's DCP format), then
``write`` and ``read`` (the two paths) and ``checkpoint_files`` (a written checkpoint as a
whole). ``settings`` holds the writer's and the reader's settings.

Importing it silences one notice of torch's: ``dcp.save`` and ``dcp.load`` without a process
group say they assume a single process. That is the intent of every single-process save and
load we run, and nothing a user can act on; any other warning still shows.
"""

import warnings

warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)
