"""Exports to Hugging Face's safetensors layout: streamed, in bounded memory, on any URL.

The ``to-safetensors`` command, the library call, and the export after each committed save.
"""
