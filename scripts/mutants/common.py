"""What every mutant table shares: the ``Mutant`` record, the files mutated and the tests run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "pytest_cudagraph"
# Code that moves between files as the package is reorganised (the manager's parts, the
# checks, the packages split along their seams): a mutant's snippet there is looked for in the
# whole package (the table marks it).
MOVING = (
    "pytest_cudagraph/manager/",
    "pytest_cudagraph/checks/builtin/",
    "pytest_cudagraph/checks/engine.py",
    "pytest_cudagraph/observe/",
    "pytest_cudagraph/precision/",
)
PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE")
WHOLE_SUITE = ("tests", "examples")

COMPARE_TESTS = ("tests/test_compare.py",)
SENSITIVITY = "tests/test_check_sensitivity.py"
DISPATCH = ("tests/test_dispatch_rules.py",)
ROWS = ("tests/test_manager_rows.py",)


def pair(buggy: str) -> str:
    """The gallery test that ``buggy`` fails its check (tests/test_checks.py)."""
    return f"tests/test_checks.py::test_buggy_module_fails_its_check[emulate-{buggy}]"


def twin(correct: str) -> str:
    """The gallery test that the correct twin ``correct`` passes every check."""
    return f"tests/test_checks.py::test_correct_twin_passes_every_check[emulate-{correct}]"


def sensitivity(*names: str) -> tuple[str, ...]:
    return tuple(f"{SENSITIVITY}::{name}" for name in names)


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # where the snippet is today (relative to the repository root)
    original: str  # exact text, found exactly once
    replacement: str
    tests: tuple[str, ...]  # pytest arguments run first (node ids or paths)
    about: str = ""
    # (original, replacement) of the same mutant in code being rewritten: tried in order when
    # ``original`` is not found (today's code and the restructured one, say).
    alternatives: tuple[tuple[str, str], ...] = ()

    @property
    def moving(self) -> bool:
        return self.file.startswith(MOVING)

    @property
    def variants(self) -> list[tuple[str, str]]:
        return [(self.original, self.replacement), *self.alternatives]


C = "pytest_cudagraph/checks/compare.py"
S = "pytest_cudagraph/checks/builtin/"  # the built-in checks: each snippet found in its family's module
X = "pytest_cudagraph/checks/verify_context.py"
GM = "pytest_cudagraph/manager/runtime.py"
LP = "pytest_cudagraph/manager/load_plans.py"
L = "pytest_cudagraph/manager/layout.py"
PP = "pytest_cudagraph/plan/properties.py"
CP = "pytest_cudagraph/plan/capture_plan.py"
E = "pytest_cudagraph/checks/engine.py"
RG = "pytest_cudagraph/checks/registry.py"
RP = "pytest_cudagraph/checks/report.py"
RC = "pytest_cudagraph/runner/checks.py"
RX = "pytest_cudagraph/runner/runner_context.py"
RV = "pytest_cudagraph/runner/verify.py"
RUNNER_TESTS = ("tests/test_runner.py",)
DM = "pytest_cudagraph/distributed/merge.py"
DL = "pytest_cudagraph/distributed/launcher.py"
DP = "pytest_cudagraph/distributed/data_parallel.py"
LE = "pytest_cudagraph/launch_env.py"
PRK = "pytest_cudagraph/plugin/ranks.py"
LAUNCHER_TESTS = "tests/test_launcher.py"
DP_TESTS = "tests/test_data_parallel.py"
EM = "pytest_cudagraph/backends/emulate.py"
FA = "pytest_cudagraph/faults.py"
PL = "pytest_cudagraph/plugin/__init__.py"
FAULT_TESTS = ("tests/test_faults.py",)
TR = "pytest_cudagraph/plan/trace.py"
CX = "pytest_cudagraph/checks/verify_context.py"
MS = "pytest_cudagraph/checks/module_state.py"
PH = "pytest_cudagraph/checks/python_held.py"
TRACE_TESTS = ("tests/test_trace.py",)
DIST_TESTS = ("tests/test_distributed.py",)
REGISTRY = ("tests/test_registry.py",)
ONE_EACH = ("tests/test_one_outcome_each.py",)
FL = "pytest_cudagraph/checks/floor.py"
OB = "pytest_cudagraph/observe/"  # a package: each snippet found in the module of its subject
CO = "pytest_cudagraph/checks/cost.py"
FLOOR_TESTS = ("tests/test_floor.py",)
PS = "pytest_cudagraph/checks/builtin/padded_size.py"
RF = "pytest_cudagraph/checks/reference.py"
PR = "pytest_cudagraph/precision/"  # a package, as OB
LA = "pytest_cudagraph/launches.py"
KERNEL_EXAMPLES = ("examples/kernels/test_kernels.py",)
LAUNCH_TESTS = ("tests/test_launches.py", f"{KERNEL_EXAMPLES[0]}::test_correct_model_passes")
FN = S
REFERENCE_TESTS = ("tests/test_reference.py",)
PRECISION_TESTS = ("tests/test_precision.py",)
SCALE_TESTS = "tests/test_scale.py"
OBSERVE_TESTS = ("tests/test_observe.py",)
DIAGNOSES = ("tests/test_diagnoses.py",)
PRT = "pytest_cudagraph/plugin/report.py"
GD = "pytest_cudagraph/guard/__init__.py"
GDV = "pytest_cudagraph/guard/host_values.py"
MT = "pytest_cudagraph/manager/types.py"
CB = "pytest_cudagraph/capturability.py"
CAPTURABILITY = ("tests/test_capturability.py",)
TRC = "pytest_cudagraph/training/checks.py"
TRH = "pytest_cudagraph/training/host_state.py"
GH = "pytest_cudagraph/guard/host.py"
QUANTIZED = ("examples/quantized/test_quantized.py",)
TORCHAO = ("examples/quantized/test_torchao.py",)
GMF = "pytest_cudagraph/manager/graph_manager.py"
LAZY_TESTS = ("tests/test_lazy_modules.py",)
INTERNAL_TESTS = ("tests/test_internal_errors.py",)
TRR = "pytest_cudagraph/training/replicas.py"
TRM = "pytest_cudagraph/training/compare.py"
TRV = "pytest_cudagraph/training/verify.py"
TRJ = "pytest_cudagraph/training/rounding.py"
ROUNDING_TESTS = ("tests/test_training_rounding.py",)
TRAINING_TESTS = ("tests/test_training.py", "examples/training/test_training_gallery.py")

EXACT = "return ((g == e) & _same_sign(g, e)) | both_nan"
