"""Tools that work on checkpoints already written: the library side of the ``dcp-fsspec`` CLI.

One module per command, each usable from Python and each adding its own subcommand: ``ls``,
``inspection`` (``inspect``), ``verify``, ``transfer`` (``cp``), ``prune``, ``convert``
(``to-torch``) and ``safetensors`` (``to-safetensors`` and ``SafetensorsExport``). Shared:
``targets`` (what a URL names), ``convert_options`` (options that load without torch),
``progress`` (the terminal bar), ``results`` and ``_cli`` (options, output, exit codes).
"""
