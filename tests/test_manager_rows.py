"""The manager's rows: real rows copied in, every padded row padded, the real rows cut out,
the padded region exactly what ``padding_views`` hands a check, and probes that
disagree with the largest batch refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pytest_cudagraph import CaptureConfig, GraphManager

D = 4
SIZES = (2, 4, 8)


class TokensAndRequests(nn.Module):
    """A per-token output and a per-request output, each from its own input (elementwise, so
    that a padded batch computes the real rows bit for bit as the unpadded one)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor, req_scale: torch.Tensor, is_padding: torch.Tensor) -> Any:
        hidden = x * self.scale + 1
        return {
            "hidden": hidden,
            "per_req": req_scale * 2,
            "masked": torch.where(is_padding[:, None], -1.0, hidden),
        }


def inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(num_tokens, D) + 1, "req_scale": torch.randn(num_reqs) + 1}


@pytest.fixture
def manager() -> Any:
    torch.manual_seed(0)
    mgr = GraphManager(
        TokensAndRequests().eval(),
        inputs,
        CaptureConfig(capture_sizes=SIZES, max_num_reqs=4, mode="FULL"),
        backend="emulate",
        pad_values={"req_scale": 7},
    )
    mgr.capture()
    yield mgr
    mgr.release()


def _batches() -> list[tuple[int, int]]:
    return [(n, r) for n in range(1, 9) for r in range(1, min(n, 4) + 1)]


def test_real_rows_are_copied_in_and_every_padded_row_padded(manager: Any) -> None:
    bufs = manager.static_inputs
    for n, r in _batches():
        batch_inputs = inputs(n, r)
        desc = manager.dispatch(num_tokens=n, num_reqs=r)
        rows, reqs = desc.num_tokens, manager.capture_reqs(desc)
        bufs["x"].fill_(99.0)
        bufs["req_scale"].fill_(99.0)
        manager.run(**batch_inputs)
        assert torch.equal(bufs["x"][:n], batch_inputs["x"]), (n, r)
        assert torch.equal(bufs["x"][n:rows], torch.zeros(rows - n, D)), (n, r)
        assert torch.equal(bufs["req_scale"][:r], batch_inputs["req_scale"]), (n, r)
        assert torch.equal(bufs["req_scale"][r:reqs], torch.full((reqs - r,), 7.0)), (n, r)
        assert bufs["is_padding"][:rows].tolist() == [False] * n + [True] * (rows - n), (n, r)


def test_run_returns_exactly_the_real_rows_of_eager(manager: Any) -> None:
    for n, r in _batches():
        batch_inputs = inputs(n, r)
        out = manager.run(**batch_inputs)
        with torch.no_grad():
            ref = manager.module(**batch_inputs, is_padding=torch.zeros(n, dtype=torch.bool))
        assert out["hidden"].shape == (n, D) and out["per_req"].shape == (r,), (n, r)
        assert torch.equal(out["hidden"], ref["hidden"]), (n, r)
        assert torch.equal(out["per_req"], ref["per_req"]), (n, r)
        assert torch.equal(out["masked"], ref["hidden"]), (n, r)  # no real row is marked as padding


def test_padding_views_are_every_padded_row_and_nothing_else(manager: Any) -> None:
    from pytest_cudagraph import Batch

    bufs = manager.static_inputs
    for n, r in _batches():
        batch = Batch(num_tokens=n, num_reqs=r)
        desc = manager.dispatch(num_tokens=n, num_reqs=r)
        rows, reqs = desc.num_tokens, manager.capture_reqs(desc)
        views = dict(manager.padding_views(desc, batch))
        expected = {"x": (n, rows), "req_scale": (r, reqs)}
        for name, (real, total) in expected.items():
            if total == real:
                assert name not in views, (name, n, r)
                continue
            view = views[name]
            assert view.shape[0] == total - real, (name, n, r)
            # It starts right after the last real row: the first padded row is in it.
            assert view.data_ptr() == bufs[name][real:].data_ptr(), (name, n, r)


def test_probes_must_agree_with_the_largest_batch() -> None:
    def grows_one_row_too_many(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        rows = num_tokens + 1 if num_tokens == 16 else num_tokens
        return {"x": torch.randn(rows, D)}

    with pytest.raises(
        ValueError,
        match=r"dimension 0 is 17 at \(num_tokens=16, num_reqs=4\) but the probes say "
        r"num_tokens = 16",
    ):
        GraphManager(
            nn.Linear(D, D),
            grows_one_row_too_many,
            CaptureConfig(capture_sizes=(16,), max_num_reqs=4, mode="FULL"),
            backend="emulate",
        )


def test_the_output_probe_never_runs_the_module_beyond_the_plans_bounds() -> None:
    """A module need not run beyond max_num_reqs (a slot table of that many rows): on a GPU an
    index out of range is a device-side assert that ends the CUDA context, not an exception."""
    from pytest_cudagraph import verify

    seen: list[tuple[int, int]] = []

    class Slots(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("slots", torch.randn(4, 8))

        def forward(self, x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
            seen.append((x.shape[0], starts.shape[0]))
            return x * 2 + 0 * self.slots[starts].sum()  # a request's slot: out of range beyond 4 requests

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, 8), "starts": torch.arange(num_reqs)}

    # Room for 11 tokens, not for 5 requests.
    report = verify(Slots(), make_inputs, capture_sizes=(1, 2, 4, 8, 16), max_num_reqs=4, backend="emulate")
    assert report.ok, report.format()
    # Batches larger than every graph run eagerly (an engine's are), but never more requests than it holds.
    assert seen and max(r for _, r in seen) <= 4, sorted(set(seen))
