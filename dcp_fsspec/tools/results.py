"""What a command that rewrites a checkpoint's tensors in another format did.

``to-torch``, ``to-safetensors`` and their functions each return one :class:`WrittenFiles`:
its :meth:`~WrittenFiles.to_dict` is the ``--json`` document, its ``lines`` what the terminal shows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_fsspec.tools.progress import human_bytes


@dataclass
class WrittenFiles:
    """What a conversion read and wrote.

    Attributes:
        src: the checkpoint's URL.
        out: the file or folder written.
        tensors: tensors written.
        bytes_written: bytes written.
        seconds: how long it took.
        left_out: entries the format cannot hold, each with its type.
    """

    src: str
    out: str
    tensors: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    left_out: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _lines(self, what: str, holds: str) -> list[str]:
        """Each entry left out (the format holds only ``holds``), then ``what`` was written."""
        written = (
            f"wrote {what}{self.tensors} tensors, {human_bytes(self.bytes_written)}, "
            f"from {self.src} in {self.seconds:.1f} s"
        )
        return [*(f"left out {entry}: safetensors holds only {holds}" for entry in self.left_out), written]
