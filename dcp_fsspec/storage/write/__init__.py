"""The write path: DCP's plan becomes data files on any backend.

Imports the format, the transport and the backends; never the read path.
"""
