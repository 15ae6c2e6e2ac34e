"""State dicts for tests: varied enough to touch every path of the format, and deterministic."""

from __future__ import annotations

from typing import Any

import torch

# Every dtype torch.save can store; float8 exists on every torch we support.
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)


def sample_state(seed: int = 0) -> dict[str, Any]:
    """Large and small tensors, every dtype, views, non-contiguous, empty, scalars, non-tensors."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 32, generator=gen)
    state: dict[str, Any] = {
        "big": torch.randn(3 * 1024 * 1024, generator=gen),  # 12 MiB: several read requests
        "matrix": torch.randn(257, 129, generator=gen),
        "transposed": torch.randn(40, 30, generator=gen).t(),
        "view_a": base[:16],  # two views sharing one storage
        "view_b": base[16:48:2],
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(3.25),
        "dtypes": {str(d).removeprefix("torch."): random_tensor((5, 3), d, gen) for d in DTYPES},
        "step": 1234,
        "name": "run-1",
        "schedule": [0.1, 0.01],
    }
    state["small"] = {
        f"t{i}": random_tensor((i + 1,), torch.int64 if i % 3 else torch.float32, gen) for i in range(50)
    }
    return state


def empty_like_state(state: Any) -> Any:
    """Same structure; tensors zeroed in fresh contiguous memory, other values blanked."""
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, list):
        return []
    if isinstance(state, str):
        return ""
    return 0


def assert_state_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Bitwise equality of every tensor (NaNs included) and equality of every other value."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        a, e = actual.contiguous(), expected.contiguous()
        if e.numel():
            assert torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)), path
    else:
        assert actual == expected, path
