"""The storage layer: DCP StorageWriter/StorageReader for any fsspec filesystem."""
