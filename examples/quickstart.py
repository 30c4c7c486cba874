"""Wrap a module, capture a graph per descriptor, run real batches through them.

Run:  python examples/quickstart.py            (CUDA if available, else the CPU emulator)
      python examples/quickstart.py --backend emulate
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pytest_cudagraph import CaptureConfig, GraphManager, GraphMode


class MLP(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "emulate"])
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if args.backend != "emulate" and torch.cuda.is_available() else "cpu"
    module = MLP().to(device).eval()

    def make_inputs(num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(num_tokens, 64, device=device)}

    config = CaptureConfig(capture_sizes=[1, 2, 4, 8, 16, 32], max_num_reqs=16, mode="FULL_AND_PIECEWISE")
    with GraphManager(module, make_inputs, config, backend=args.backend) as manager:
        manager.capture()
        print(f"{manager!r}: captured in {manager.capture_seconds:.3f} s")
        worst = 0.0
        exact = 0
        for num_tokens in range(1, 41):
            x = torch.randn(num_tokens, 64, device=device)
            desc = manager.dispatch(num_reqs=min(num_tokens, 16), num_tokens=num_tokens)
            out = manager.run(x=x)
            with torch.no_grad():
                ref = module(x)
            diff = (out - ref).abs().max().item()
            worst = max(worst, diff)
            exact += bool(torch.equal(out, ref))
            if num_tokens in (1, 3, 17, 32, 33, 40):
                served = desc.label() if desc.mode is not GraphMode.NONE else "NONE (eager)"
                print(f"  batch of {num_tokens:2d} tokens -> {served:<20} max |graph - eager| = {diff:.2e}")
        print(f"40 real batches: {exact} bit-identical to unpadded eager, worst difference {worst:.2e}")


if __name__ == "__main__":
    main()
