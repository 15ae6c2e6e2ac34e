"""The bytes on storage: torch's DCP format, read and written without running torch.save.

File names, per-tensor records, their headers and CRC-32s, ``.metadata`` and its allow-listed
unpickling, references and content hashes. Imports the transport only, never the read or write paths.
"""
