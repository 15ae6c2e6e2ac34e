"""The read path: files on any backend become the caller's tensors.

Ranged reads, record decoding into place, cooperative reads over the process group, and the
safetensors reader. Imports the format, the transport and the backends; never the write path.
"""
