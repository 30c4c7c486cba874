"""``determinism`` and ``rng``: replays that agree with themselves, and random draws that follow
the generator.
"""

from __future__ import annotations

from typing import Any

from ...plan import BatchDescriptor
from .. import causes
from ..compare import Difference, first_difference, same_print, tree_print
from ..registry import Check
from ..report import Finding, Outcome
from ..verify_context import VerifyContext
from .common import finding_of, where_of


def determinism(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    first = ctx.first_replay.pop(desc, None)
    if first is not None:
        batch, inputs, kept = first
    else:
        batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
        inputs = ctx.make(batch)

    # Replays of the same inputs from one state and seed, the graphs' free memory (their
    # intermediates between replays) poisoned just before each: one poison, then the other. Where
    # they agree, the graph neither reads what nobody wrote (it would give one result per poison,
    # where plain replays read whatever the last one left) nor runs nondeterministic kernels or
    # keeps state outside registered buffers. Where they differ, a third replay with the first
    # poison tells which: it agrees with the first (the poison decided) or not (the graph does
    # not repeat itself). Two replays where a graph passes, as the three (one poison twice, then
    # the other) that always ran before issue #48. A backend that cannot poison replays plainly.
    #
    # For a module that draws nothing (seen op by op), the second replay also takes another seed.
    # Where the two agree, the graph draws nothing either: rng's question for such a module, which
    # it then takes from here (``ctx.seed_free``) instead of replaying twice more. Where they
    # differ, the second replay runs again under the first's seed, and everything below is judged
    # on replays of one seed, as before.
    poisonable = True
    two_seeds = not ctx.module_is_random(desc)

    def poisoned(which: int, seed: int | None = None) -> Any:
        nonlocal poisonable
        ctx.load(desc, inputs, batch)
        poisonable = ctx.manager.poison_free(which) and poisonable
        if seed is not None:
            ctx.seed_all(seed)
        return ctx.replay(desc)

    # poison 0, then poison 1 (under the next seed, for a module that draws nothing). The first may
    # be fresh_inputs' replay, made of these inputs from one state and seed with the free memory
    # poisoned the first way just before it (``ctx.shares_replay``: nothing between the two checks
    # but graph memory can change what a replay gives), kept as its print: where the second has
    # that print they agree, one replay of the same inputs fewer; where not, both are made here.
    diff: Difference | None = None
    graph_diff: Difference | None = None
    shared = False
    if first is not None:
        second = ctx.from_one_state(lambda _: poisoned(1, ctx.seed + 1 if two_seeds else None), 1)[0]
        printed = tree_print(second)
        shared = printed is not None and same_print(printed, kept)
        if shared and two_seeds:
            ctx.seed_free.add(desc)
    if not shared:
        outs = ctx.from_one_state(lambda i: poisoned(i, ctx.seed + i if two_seeds else None), 2)
        diff = first_difference(outs[1], outs[0])
        if two_seeds and diff is None:
            ctx.seed_free.add(desc)
        elif two_seeds:
            outs[1] = ctx.from_one_state(lambda _: poisoned(1), 1)[0]
            diff = first_difference(outs[1], outs[0])
        if poisonable and diff is not None:
            again = ctx.from_one_state(lambda _: poisoned(0), 1)[0]
            repeated = first_difference(again, outs[0])
            graph_diff, diff = (diff, None) if repeated is None else (None, repeated)
    read_poison = (
        f"with the graph's free memory poisoned one way before each of two replays of the same inputs they agree, "
        f"and poisoned the other way they differ ({where_of(graph_diff)})"
        if graph_diff is not None
        else ""
    )
    uninitialized = ctx.uninitialized()
    if uninitialized:
        # Undefined whether the two replays happened to agree: the memory they read is anybody's.
        shown = diff or graph_diff
        return Outcome(
            "determinism",
            desc,
            False,
            f"{uninitialized}; a replay reads it too: {read_poison}" if read_poison else uninitialized,
            finding_of(shown, batch) if shown is not None else Finding(real_batch=batch.shape()),
        )
    if graph_diff is not None:
        return Outcome(
            "determinism",
            desc,
            False,
            f"a replay reads graph memory nobody wrote: {read_poison}. No op the dispatcher sees reads "
            "unwritten memory, so it happens below it (in a custom op's or an extension's own buffer, say): write "
            "that buffer fully first, or make it with zeros",
            finding_of(graph_diff, batch),
        )
    if diff is None:
        return Outcome("determinism", desc, True)
    return Outcome(
        "determinism",
        desc,
        False,
        f"two replays of the same inputs, from the same module state and seed, differ ({where_of(diff)}): "
        "the module keeps state outside its registered buffers, or uses nondeterministic kernels",
        finding_of(diff, batch),
    )


def rng(ctx: VerifyContext, desc: BatchDescriptor) -> Outcome:
    if ctx.uninitialized():
        # What a replay and an eager run read from unwritten memory is the allocator's, so their
        # agreement, and eager's with itself, would be chance: the verdict would change run to run.
        return Outcome(
            "rng",
            desc,
            True,
            skipped=True,
            message="the forward reads memory nobody wrote, so draws cannot be compared (determinism reports it)",
        )
    batch = ctx.padded_batch(desc) or ctx.exact_batch(desc)
    host = ctx.host_draws()
    if host:
        # What a graph draws from host numbers it froze is the capture's draw, replay after replay:
        # the replays below would agree with themselves under any seed, and eager with nothing.
        return Outcome("rng", desc, False, causes.host_numbers(host), Finding(real_batch=batch.shape()))
    if not ctx.module_is_random(desc):
        # Eager draws nothing: the graph must not either. Replays alone say so;
        # where they disagree the full comparison below tells why.
        if desc in ctx.seed_free:
            # determinism replayed this graph under two seeds, with the same result
            return Outcome(
                "rng",
                desc,
                True,
                message="the module draws no random numbers",
                figures={"random": False, "replays": "determinism's, under two seeds"},
            )
        inputs = ctx.make(batch)

        def replayed() -> Any:
            ctx.load(desc, inputs, batch)
            return ctx.replay(desc)

        with ctx.preserved_state() as state0:
            replays = []
            for seed in (ctx.seed, ctx.seed + 1):
                ctx.restore(state0)
                ctx.seed_all(seed)
                replays.append(replayed())
        if first_difference(replays[0], replays[1]) is None:
            return Outcome(
                "rng", desc, True, message="the module draws no random numbers", figures={"random": False}
            )
    else:
        inputs = ctx.make(batch)
    draws: dict[tuple[str, int], Any] = {}
    with ctx.preserved_state() as state0:
        padded = ctx.load(desc, inputs, batch)
        for seed in (ctx.seed, ctx.seed + 1):
            ctx.restore(state0)
            ctx.seed_all(seed)
            draws["eager", seed] = ctx.eager(padded, desc)
            ctx.restore(state0)
            ctx.load(desc, inputs, batch)
            ctx.seed_all(seed)
            draws["graph", seed] = ctx.replay(desc)
        ctx.restore(state0)
        again = ctx.replay(desc)  # no reseed: the generator has moved on
        ctx.restore(state0)
        ctx.seed_all(ctx.seed)
        repeat = ctx.eager(padded, desc)
    s0, s1 = ctx.seed, ctx.seed + 1
    if first_difference(repeat, draws["eager", s0]) is not None:
        return Outcome(
            "rng",
            desc,
            True,
            skipped=True,
            message="eager is not reproducible under the same seed and state, so draws cannot be "
            "compared (the determinism and replay checks report why)",
        )
    # Random if either side's output depends on the seed.
    random = any(
        first_difference(draws[side, s0], draws[side, s1]) is not None for side in ("eager", "graph")
    )
    if not random:
        return Outcome(
            "rng", desc, True, message="the module draws no random numbers", figures={"random": False}
        )
    diff = first_difference(draws["graph", s0], draws["eager", s0])
    if diff is not None:
        return Outcome(
            "rng",
            desc,
            False,
            f"under the same seed, replay draws differ from eager draws ({where_of(diff)}): the graph does "
            "not read the seeded generator the way eager does (a seed set inside forward, or a private "
            "generator)",
            finding_of(diff, batch),
        )
    # ``again`` follows the seed-s1 replay without reseeding: the generator
    # must have moved on since.
    if first_difference(again, draws["graph", s1]) is None:
        return Outcome(
            "rng",
            desc,
            False,
            "two successive replays drew the same random values: the graph does not advance the generator",
            Finding(output=""),
        )
    return Outcome("rng", desc, True, figures={"random": True})


DETERMINISM = Check(
    "determinism",
    determinism,
    compares="two replays of the same inputs, from the same state and seed, are bit-identical; and no "
    "forward reads memory nobody wrote: an op seen reading what `torch.empty` (or kin) handed back "
    "before anything wrote it, confirmed by two eager runs with that memory poisoned two ways, is "
    "named with the op that made it (and every other failure of the module says so first); and "
    "replays with the graphs' free pool memory (their intermediates between replays) poisoned one "
    "way, then the other, agree (where they differ, a third with the first poison tells a read of "
    "what nobody wrote, below the dispatcher, from a graph that does not repeat itself). For a "
    "module seen drawing nothing the second replay also takes the next seed, which answers `rng` "
    "there; where that pair differs, the second runs again under the first seed. Where nothing but graph "
    "memory can change a replay, the first is `fresh_inputs`' replay, made with the first poison",
    catches="state kept outside registered buffers, nondeterministic kernels, a split-K sum into "
    "`torch.empty`, in eager or only in the graph",
    applies="never",
)


RNG = Check(
    "rng",
    rng,
    compares="with a seeded generator, replay draws equal eager draws, and successive replays draw fresh "
    "values; a module is random when its forwards use a generator (seen op by op), never because "
    "two runs differ (Python state, put back between runs, and unwritten memory do that). For a "
    "module that draws nothing, two replays under two seeds agree (`determinism`'s, where it ran)",
    catches="seeding inside `forward`, generators a graph does not advance; a seed or offset kept in Python "
    "and handed to a kernel (a custom op, a Triton launch) as a number that moves on every call, which a "
    "graph freezes so that every replay repeats the capture's draw: found by two eager forwards of the same "
    "inputs from one state, whose kernels are handed other numbers, and named with the kernel, its line, "
    "the numbers and the attribute that keeps them",
    applies="eager itself is not reproducible under one seed (the `determinism` and replay checks say why)",
)
