import sys

import torch

sys.path.insert(0, ".")
from pytest_cudagraph.training import verify_training

D = 64


class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.a = torch.nn.Linear(D, 128)
        s.b = torch.nn.Linear(128, D)
        s.d = torch.nn.Dropout(0.1)

    def forward(s, x):
        return s.b(s.d(torch.nn.functional.gelu(s.a(x))))


class BN(M):
    def __init__(s):
        super().__init__()
        s.n = torch.nn.BatchNorm1d(128)

    def forward(s, x):
        return s.b(s.n(s.a(x)))


def make(t, r):
    return {"x": torch.randn(t, D, device="cuda"), "w": torch.ones(t, device="cuda")}


def masked(out, inputs):
    return ((out**2).mean(-1) * inputs["w"]).sum() / inputs["w"].sum().clamp(min=1)


def unmasked(out, inputs):
    return (out**2).mean()


cap = lambda p: torch.optim.AdamW(p, lr=1e-2, capturable=True)
torch.manual_seed(0)
for name, mod, loss, opt in [
    ("masked capturable", M, masked, cap),
    ("unmasked", M, unmasked, cap),
    ("noncapturable", M, masked, lambda p: torch.optim.AdamW(p, lr=1e-2)),
    ("no opt", M, masked, None),
    ("bn", BN, masked, cap),
    ("sgd", M, masked, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
]:
    try:
        r = verify_training(mod().cuda(), make, loss, optimizer=opt, capture_sizes=(2, 4, 8))
        print("==", name, r.ok)
        print(r.format()[:900])
    except Exception:
        import traceback

        traceback.print_exc()
