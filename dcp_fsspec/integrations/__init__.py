"""Training frameworks that save to any fsspec URL through dcp_fsspec, one module each.

``dcp_fsspec.integrations.lightning`` (``pip install 'dcp-fsspec[lightning]'``),
``dcp_fsspec.integrations.hf`` (``pip install 'dcp-fsspec[hf]'``),
``dcp_fsspec.integrations.ray`` (``pip install 'dcp-fsspec[ray]'``) and
``dcp_fsspec.integrations.torchtitan`` (``pip install 'dcp-fsspec[torchtitan]'``). Each module imports its
framework when it is itself imported, and only then: ``import dcp_fsspec`` and the
``dcp-fsspec`` command never import one. A framework that is missing is a one-line
:class:`~dcp_fsspec.errors.MissingDriverError` naming the extra to install.
"""
