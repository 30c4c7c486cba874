"""Skip reasons fit the terminal (#66): each one line of at most ``REASON_LIMIT`` characters, in plain
words that say what was not checked and why for the user's module and inputs; what more there is to
say is the skip's detail, which the JSON report and ``-v`` show."""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pytest_cudagraph import verify
from pytest_cudagraph.checks import skipped
from pytest_cudagraph.checks.report import REASON_LIMIT, Outcome, fitted_reason
from pytest_cudagraph.plugin.report import REPORT_SCHEMA
from tests.bugs import (
    DrawsNoise,
    HostOffsetSampler,
    HostSync,
    NoMemo,
    SplitKIntoEmpty,
    TokenStatisticsInBf16Kernel,
    token_inputs,
)

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
SIZES = (1, 2, 4, 8)


# -- the one place: every skip outcome's reason is fitted -----------------------------------------
def test_a_reason_that_fits_is_kept_as_it_is() -> None:
    reason = "no real batch of this descriptor leaves padded rows"
    assert fitted_reason(reason) == (reason, "")
    assert fitted_reason(reason, "more") == (reason, "more")
    assert fitted_reason("x" * REASON_LIMIT) == ("x" * REASON_LIMIT, "")


def test_a_longer_reason_keeps_its_first_clauses_and_its_whole_text_leads_the_detail() -> None:
    long = (
        "the module cannot run in float64 nor in float32 (its forward raises in float64: TypeError: this "
        "kernel takes bfloat16; in float32: the same), so no reference holds eager across shapes; "
        "real_batches held the graph to eager on the unpadded batch instead"
    )
    reason, detail = fitted_reason(long, "a detail of its own")
    assert reason == (
        "the module cannot run in float64 nor in float32 (its forward raises in float64: TypeError: this "
        "kernel takes bfloat16; in float32: the same)"
    )
    assert detail == f"{long}\na detail of its own"
    # Never cut inside parentheses (at their colon or semicolon): before them.
    inside = (
        "the module cannot run in float64 (TypeError: this kernel takes bfloat16; " + "and more " * 20 + ")"
    )
    assert fitted_reason(inside)[0] == "the module cannot run in float64"


def test_the_longest_start_that_ends_a_clause_is_kept() -> None:
    long = "first: second clause, so a third; " + "word " * 40
    reason, detail = fitted_reason(long)
    assert reason == "first: second clause, so a third"
    assert detail == " ".join(long.split())


def test_a_reason_with_no_clause_to_end_at_is_cut_at_a_word() -> None:
    long = "word " * 60
    reason, detail = fitted_reason(long)
    assert reason.endswith("word...") and len(reason) <= REASON_LIMIT
    assert detail == " ".join(long.split())
    assert fitted_reason("x" * 300)[0] == "x" * (REASON_LIMIT - 3) + "..."


def test_a_reason_of_several_lines_keeps_its_first() -> None:
    assert fitted_reason("the cache is not paged here\n  its pages: none\n") == (
        "the cache is not paged here",
        "the cache is not paged here\nits pages: none",
    )


@given(st.text(min_size=1), st.text())
def test_every_reason_is_one_line_that_fits_and_nothing_is_lost(reason: str, detail: str) -> None:
    fitted, more = fitted_reason(reason, detail)
    assert len(fitted.splitlines()) <= 1 and len(fitted) <= REASON_LIMIT
    if (fitted, more) != (reason, detail):
        assert " ".join(more.split()).startswith(" ".join(reason.split()))
        assert more.endswith(detail)
    assert fitted_reason(fitted, more) == (fitted, more)  # a fitted reason stays as it is


def test_every_skip_outcome_is_fitted_where_it_is_made_and_a_failure_is_not() -> None:
    long = "the KV cache is not paged in this engine (" + "a page table of the engine's own " * 8 + ")"
    outcome = Outcome("mine", None, True, long, skipped=True)
    assert outcome.message == "the KV cache is not paged in this engine" and outcome.detail == long
    assert outcome.to_dict()["message"] == outcome.message and outcome.to_dict()["detail"] == long
    failure = Outcome("mine", None, False, long)
    assert failure.message == long and failure.detail == ""
    # A check of your own says both through skipped().
    mine = skipped("the KV cache is not paged here", detail="the engine keeps one contiguous cache")
    assert (mine.message, mine.detail) == (
        "the KV cache is not paged here",
        "the engine keeps one contiguous cache",
    )
    assert skipped("first line\nsecond line").message == "first line"
    with pytest.raises(ValueError, match="needs the reason"):
        skipped("  ")
    with pytest.raises(ValueError, match="detail must be a string"):
        skipped("why", detail=3)  # type: ignore[arg-type]


def test_the_schema_says_the_limit() -> None:
    schema = REPORT_SCHEMA.read_text()
    assert f"one line of at most {REASON_LIMIT} characters" in schema
    assert '"detail"' in schema


# -- padding_isolation: what it means for the user's inputs -----------------------------------------
class Embeds(nn.Module):
    """Token ids in, embeddings out; optional flags (boolean) and a scale of fixed size."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)

    def forward(
        self, ids: torch.Tensor, flags: torch.Tensor | None = None, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.emb(ids)
        if flags is not None:
            out = torch.where(flags[:, None], out, -out)
        if scale is not None:
            out = out * scale.sum()
        return out


def token_ids(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    return {"ids": torch.randint(0, 32, (num_tokens,))}


def constant_ids(num_tokens: int, num_reqs: int) -> dict[str, Any]:
    return {
        "ids": torch.zeros(num_tokens, dtype=torch.long),
        "flags": torch.ones(num_tokens, dtype=torch.bool),
        "scale": torch.ones(3),
    }


def _padding(make_inputs: Any, **kwargs: Any) -> dict[str, Outcome]:
    torch.manual_seed(0)
    report = verify(
        Embeds(),
        make_inputs,
        capture_sizes=SIZES,
        max_num_reqs=4,
        backend="emulate",
        checks=["padding_isolation"],
        **kwargs,
    )
    assert report.ok, report.format()
    return {o.descriptor.label(): o for o in report.outcomes if o.descriptor is not None}


def test_token_ids_are_filled_and_where_only_requests_are_padded_the_reason_says_so() -> None:
    """The reason an input_ids input got read 'integer inputs hold one value each': untrue. Integer
    ids are filled where tokens are padded; where only the request count is, no input has a padded
    row, and the reason says that of the user's input."""
    outcomes = _padding(token_ids)
    for label in ("FULL-T8-R4", "FULL-T4-R4"):
        assert not outcomes[label].skipped and outcomes[label].figures["integer"] == ["ids"]
    t2 = outcomes["FULL-T2-R2"]
    assert t2.skipped
    assert (
        t2.message
        == "no padded row to fill: only requests (1 of 2) are padded here; 'ids' has a row per token"
    )
    assert "in this descriptor's most padded real batch (num_tokens=2 of 2, num_reqs=1 of 2)" in t2.detail
    assert t2.detail.endswith(
        "no input has padded rows it can fill: 'ids' has a row per token, and no token is padded"
    )
    assert "integer inputs: the largest make_inputs gives, then others in its range" in t2.detail
    assert outcomes["FULL-T1-R1"].message == "no real batch of this descriptor leaves padded rows"


def test_each_input_that_cannot_be_filled_is_told_by_its_cause() -> None:
    outcomes = _padding(constant_ids)
    t8 = outcomes["FULL-T8-R4"]
    # Named while they fit, the rest counted; the detail names every one.
    assert t8.message == (
        "no padded row to fill: tokens (5 of 8) and requests (3 of 4) are padded here; make_inputs gives "
        "'ids' one value; 2 more inputs: the detail says why"
    )
    assert t8.detail.endswith(
        "make_inputs gives 'ids' one value at this descriptor's shape, so no other value is known to be valid "
        "there (an index that stays an index); 'flags' is boolean: padded rows keep its pad value; 'scale' "
        "does not follow the batch (a fixed size)"
    )
    assert outcomes["FULL-T2-R2"].message == (
        "no padded row to fill: only requests (1 of 2) are padded here; 'ids' and 'flags' have a row per "
        "token; 'scale' does not follow the batch"
    )
    declared = _padding(token_ids, pad_values={"ids": 0})["FULL-T8-R4"]
    assert declared.message == (
        "no padded row to fill: tokens (5 of 8) and requests (3 of 4) are padded here; pad_values declares "
        "the padding of 'ids'"
    )


# -- every reason the package gives is written to fit, not cut ---------------------------------------
def _ids_verify() -> Any:
    torch.manual_seed(0)
    return verify(
        Embeds(), token_ids, capture_sizes=SIZES, max_num_reqs=4, backend="emulate", exhaustive=True
    )


def _gallery(module: type[nn.Module], **kwargs: Any) -> Any:
    def run() -> Any:
        torch.manual_seed(0)
        return verify(
            module(), token_inputs(), capture_sizes=SIZES, max_num_reqs=4, backend="emulate", **kwargs
        )

    return run


# (how to verify, the reasons its skips give: each check's, word for word)
SKIPPING = {
    "capture fails": (
        _gallery(HostSync),
        {
            "replay_matches_eager": "not captured: its capture failed (capture_safety says why)",
            "dispatch": "nothing was captured (capture_safety says why)",
            "padded_size": "not captured: its capture failed (capture_safety says why)",
        },
    ),
    "random numbers": (
        _gallery(DrawsNoise),
        {
            "real_batches": "the module draws random numbers, which cannot match unpadded eager draw for draw "
            "(the rng check covers them)",
            "padded_size": "the module draws random numbers, which cannot match across shapes draw for draw (the "
            "rng check covers them)",
        },
    ),
    "host numbers": (
        _gallery(HostOffsetSampler),
        {
            "real_batches": "the module hands a kernel host numbers that move on every call, so eager cannot "
            "match itself across runs (the rng check names them)",
            "padded_size": "the module hands a kernel host numbers that move on every call, so eager cannot "
            "match itself across shapes (the rng check names them)",
        },
    ),
    "memory nobody wrote": (
        _gallery(SplitKIntoEmpty),
        {
            "rng": "the forward reads memory nobody wrote, so draws cannot be compared (determinism reports it)"
        },
    ),
    "quick mode": (
        _gallery(NoMemo, exhaustive=False),
        {"dispatch": "quick verification (exhaustive=False) does not property-test dispatch"},
    ),
    "no float64": (
        _gallery(TokenStatisticsInBf16Kernel),
        # padded_size's reason is the exception's words: the one place cuts it to its first clause.
        {"padded_size": "the module cannot run in float64 nor in float32"},
    ),
    "token ids": (
        _ids_verify,
        {"padding_isolation": "no real batch of this descriptor leaves padded rows"},
    ),
}


@pytest.mark.parametrize("case", list(SKIPPING))
def test_every_skip_reason_is_one_line_that_fits_in_plain_words(case: str) -> None:
    run, expected = SKIPPING[case]
    report = run()
    reasons: dict[str, set[str]] = {}
    for o in report.skips:
        assert len(o.message.splitlines()) == 1 and len(o.message) <= REASON_LIMIT, o.message
        assert fitted_reason(o.message, o.detail) == (o.message, o.detail)
        reasons.setdefault(o.check, set()).add(o.message)
        # Written to fit: a reason is cut only where its words are an exception's (padded_size's).
        if o.check != "padded_size":
            assert not (o.detail and " ".join(o.detail.split()).startswith(o.message)), o.detail
    for check, reason in expected.items():
        assert reason in reasons.get(check, set()), (check, reasons.get(check))
    assert reasons, "the case skips nothing"


def test_host_numbers_keep_their_detail() -> None:
    report = _gallery(HostOffsetSampler)()
    (detail,) = {o.detail for o in report.skips if o.check == "real_batches"}
    assert detail.startswith("a seed or an offset kept in Python and handed to a kernel")


# -- verify_training's skips: the reason, then the detail ----------------------------------------------
class _Normed(nn.Module):
    """A BatchNorm in train mode: eager's step cannot take one row alone."""

    def __init__(self) -> None:
        super().__init__()
        from examples.training.gallery import Mlp

        self.norm, self.mlp = nn.BatchNorm1d(16), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


def test_training_skips_say_why_in_one_line_and_keep_the_rest_in_the_detail() -> None:
    from examples.training.gallery import Mlp, masked_loss
    from examples.training.gallery import token_inputs as training_inputs
    from pytest_cudagraph import verify_training

    sizes: dict[str, Any] = {"capture_sizes": (2, 4), "max_num_reqs": 4, "optimizer": None}
    torch.manual_seed(0)
    declared = verify_training(Mlp(), training_inputs(), masked_loss, pad_values={"x": 0}, **sizes)
    padding = [o for o in declared.skips if o.check == "training_padding"]
    assert padding and all(
        o.message == "no input that forward names has padded rows that can hold other values" for o in padding
    )
    assert "those in pad_values" in padding[0].detail and "**kwargs" in padding[0].detail
    torch.manual_seed(0)
    normed = verify_training(_Normed(), training_inputs(), masked_loss, **sizes)
    (real,) = [o for o in normed.skips if o.check == "training_real_batches"]
    assert (
        real.message
        == "eager's step fails on the real batch of 1 token alone, so there is nothing to hold the graph to"
    )
    assert real.detail.startswith("ValueError: Expected more than 1 value per channel when training")


# -- the terminal summary and the JSON report ---------------------------------------------------------
SUITE = """
import torch
from pytest_cudagraph.checks import Check, skipped
from tests.test_skip_reasons import Embeds, token_ids

LONG = "the KV cache is not paged in this engine (" + "a page table of the engine's own, " * 8 + "none here)"
PAGED = Check("paged", lambda ctx, desc: skipped(LONG), compares="the paged cache")


def test_ids(cudagraph_verify):
    torch.manual_seed(0)
    cudagraph_verify(
        Embeds(), token_ids, capture_sizes=[1, 2, 4, 8], max_num_reqs=4, exhaustive=True, extra_checks=[PAGED]
    )
"""

_LINE = re.compile(r"^ +(\d+) x (.*) \(([^()]*)\)$")


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE)
    pytester.syspathinsert(ROOT)
    sys.path.insert(0, ROOT)
    return pytester


def _skip_lines(result: pytest.RunResult) -> list[str]:
    lines = result.stdout.lines
    start = next(
        i for i, line in enumerate(lines) if re.match(r"cudagraph: \d+ checks skipped, by reason", line)
    )
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    return lines[start:end]


def test_the_terminal_prints_each_reason_on_one_line_and_the_detail_under_v(suite: pytest.Pytester) -> None:
    result = suite.runpytest("--cudagraph-backend=emulate", "--cudagraph-report=report.json")
    result.assert_outcomes(passed=1)
    header, *lines = _skip_lines(result)
    assert header.endswith("by reason (-v: each with its checks and detail):")
    reasons = {}
    for line in lines:
        found = _LINE.match(line)
        assert found, line  # one line a reason, its count and checks on it: no detail without -v
        reasons[found.group(2)] = found.group(3)
        assert len(found.group(2)) <= REASON_LIMIT
    assert reasons == {
        "no real batch of this descriptor leaves padded rows": "padding_isolation",
        "no padded row to fill: only requests (1 of 2) are padded here; 'ids' has a row per token": "padding_isolation",
        "the KV cache is not paged in this engine": "paged",
    }
    # The JSON report holds each skip's detail, and each group's.
    data = json.loads((suite.path / "report.json").read_text())
    (record,) = data["tests"]["test_suite.py::test_ids"]["verifications"]
    paged = [o for o in record["report"]["outcomes"] if o["check"] == "paged"]
    assert paged and all(o["message"] == "the KV cache is not paged in this engine" for o in paged)
    assert all(
        o["detail"].startswith("the KV cache is not paged in this engine (a page table") for o in paged
    )
    (group,) = [g for g in record["report"]["skipped"] if g["check"] == "paged"]
    assert group["details"] == [paged[0]["detail"]] and len(group["where"]) == 4

    verbose = suite.runpytest("--cudagraph-backend=emulate", "-v")
    header, *lines = _skip_lines(verbose)
    assert header.endswith("by reason:")
    text = "\n".join(lines)
    assert "         padding_isolation fills padded rows with other values" in text
    assert f"         {paged[0]['detail']}" in text


def test_a_reason_every_check_shares_counts_them_and_v_names_them() -> None:
    from pytest_cudagraph.plugin.report import skipped_lines

    checks = ["determinism", "fresh_inputs", "real_batches", "rng", "state"]
    reason = "not captured: its capture failed (capture_safety says why)"
    outcomes = [{"check": c, "skipped": True, "message": reason, "detail": ""} for c in checks]
    results = {"test_x.py::test_x": [{"report": {"outcomes": outcomes}}]}
    assert skipped_lines(results) == [
        "cudagraph: 5 checks skipped, by reason (-v: each with its checks and detail):",
        f"     5 x {reason} (5 checks)",
    ]
    assert skipped_lines(results, verbose=True) == [
        "cudagraph: 5 checks skipped, by reason:",
        f"     5 x {reason} (5 checks)",
        "         checks: determinism, fresh_inputs, real_batches, rng, state",
    ]
    few = {"test_x.py::test_x": [{"report": {"outcomes": outcomes[:2]}}]}
    assert skipped_lines(few) == [
        "cudagraph: 2 checks skipped, by reason:",
        f"     2 x {reason} (determinism, fresh_inputs)",
    ]
