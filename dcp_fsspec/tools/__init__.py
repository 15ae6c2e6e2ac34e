"""Tools that work on checkpoints already written: the library side of the ``dcp-fsspec`` CLI.

One module per job, each usable from Python and each adding its own subcommand:
``targets`` (what a URL names: a checkpoint, an iteration folder or a ``save_dirname``),
``listing`` (``ls``), ``inspection`` (``inspect``), ``verify``, ``transfer`` (``cp``),
``prune``, ``convert`` (``to-torch``, ``to-safetensors``; their options in ``convert_options``
and ``safetensors_cli``, which load without torch), ``progress`` (the terminal bar) and
``_cli`` (what the subcommands share: options, output, exit codes).
"""
