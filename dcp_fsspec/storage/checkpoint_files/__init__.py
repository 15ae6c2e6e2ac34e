"""A written checkpoint as a whole: copying it, making it self-contained, checking its integrity.

Imports the format, the transport, the backends and the read path's fetching.
"""
