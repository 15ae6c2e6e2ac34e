"""The storage layer: DCP StorageWriter/StorageReader for any fsspec filesystem.

Importing it silences one notice of torch's: ``dcp.save`` and ``dcp.load`` without a process
group say they assume a single process. That is the intent of every single-process save and
load we run, and nothing a user can act on; any other warning still shows.
"""

import warnings

warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)
