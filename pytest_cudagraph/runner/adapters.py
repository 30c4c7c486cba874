"""Runners made of PyTorch's own CUDA-graph machinery, for ``verify_runner``.

``compiled(module)`` is ``torch.compile(mode="reduce-overhead")`` (CUDA graph
trees) run on each real batch as it comes; ``graphed_callables(module, ...)``
is ``torch.cuda.make_graphed_callables``, one graph per capture size, with
the padding and row-cutting an inference engine does around it. Both are
callables ``runner(**inputs)`` on the keyword inputs of one real (unpadded)
batch with a ``capture()`` method, as ``verify_runner`` expects::

    runner = compiled(model, clone_outputs=True, make_inputs=make_inputs, warmup_sizes=range(1, 9))
    report = verify_runner(runner, model, make_inputs, capture_sizes=[1, 2, 4, 8])

Both need a CUDA device: CUDA graphs exist nowhere else.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..plan.validate import int_list, optional_int

__all__ = ["CompiledRunner", "GraphedRunner", "compiled", "graphed_callables", "skips_recorded"]


@contextmanager
def _buffers_copied_back(module: torch.nn.Module) -> Iterator[None]:
    """Put the module's buffers back as they were when the block ends. Copies
    them all rather than watching writes (``observe.restoring``): the block runs
    someone else's compiled code, which a dispatch mode would change."""
    snapshot = {name: t.detach().clone() for name, t in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, t in module.named_buffers():
                if name in snapshot:
                    t.copy_(snapshot[name])


#: ``pad_values`` entry that repeats an input's last real row into its padded rows.
EDGE = "edge"


def _require_cuda(what: str) -> None:
    """A clear error instead of torch's own deep one when there is no GPU to graph on."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA device: CUDA graphs are recorded and replayed on a GPU, and torch sees none "
            f"here (torch {torch.__version__}, built with CUDA {torch.version.cuda}). Run on a machine with a "
            "GPU and a CUDA build of torch; on the CPU, verify the module with pytest_cudagraph.verify "
            "(its emulated backend), or mark the test @pytest.mark.cuda so that it skips here."
        )


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to each tensor in tensors, tuples, lists and dicts (others as they are)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: rebuild it field by field
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


# ---------------------------------------------------------------------------
# torch.compile(mode="reduce-overhead")
# ---------------------------------------------------------------------------


def _cudagraph_skip_logger() -> logging.Logger:
    """The logger ``log_cudagraph_skip_and_bump_counter`` warns on (the 'cudagraphs' logging artifact).

    Taken from the module object, not spelled out, so that a renamed artifact
    logger is still the one we listen to; the name is the fallback.
    """
    try:
        from torch._inductor import cudagraph_utils

        log = getattr(cudagraph_utils, "cudagraphs_log", None)
        if isinstance(log, logging.Logger):
            return log
    except ImportError:  # a torch without inductor: nothing will log there, listening costs nothing
        pass
    return logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")


def _dynamo_fallback_logger() -> logging.Logger:
    """The logger dynamo warns on when it gives a frame up and runs it eagerly (recompile limit, suppressed errors)."""
    try:
        from torch._dynamo import convert_frame

        log = getattr(convert_frame, "log", None)
        if isinstance(log, logging.Logger):
            return log
    except ImportError:
        pass
    return logging.getLogger("torch._dynamo.convert_frame")


def _skip_counter() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


class _Recorder(logging.Handler):
    """Collects the messages of WARNING records while attached."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.messages.append(record.getMessage())
        except Exception:  # a malformed record must not break the user's call
            self.messages.append(str(record.msg))


@contextmanager
def skips_recorded(record: Callable[[Iterable[str]], None]) -> Iterator[None]:
    """Give ``record`` torch's reasons for running without CUDA graphs while the body runs.

    Two sources, as torch reports a skip in two ways at once
    (``log_cudagraph_skip_and_bump_counter``): the warning on the
    'cudagraphs' artifact logger, which has the reason, and
    ``counters["inductor"]["cudagraph_skips"]``, which every skip bumps,
    also those torch does not log (a graph without CUDA tensors) and
    those a logging configuration filters out (the handler here sees
    only what passes the logger's level; the counter sees all). A count
    the messages do not account for is recorded as a reason of its own.
    Dynamo's warnings that it gave a frame up and ran it eagerly (the
    recompile limit, a suppressed compile error) are recorded too: no
    CUDA graph runs in an eager frame either.
    """
    graphs, frames = _Recorder(), _Recorder()
    graph_log, frame_log = _cudagraph_skip_logger(), _dynamo_fallback_logger()
    before = _skip_counter()
    graph_log.addHandler(graphs)
    frame_log.addHandler(frames)
    try:
        yield
    finally:
        graph_log.removeHandler(graphs)
        frame_log.removeHandler(frames)
        after = _skip_counter()
        # counters.clear() (torch._dynamo.reset) during the call restarts the count from zero
        bumped = after - before if after >= before else after
        logged = [m for m in graphs.messages if m]
        record(logged)
        if bumped > len(logged):
            record(
                [
                    f"torch.compile skipped CUDA graphs for {bumped - len(logged)} compiled graph(s) without a "
                    "logged reason (counters['inductor']['cudagraph_skips'] rose by "
                    f"{bumped}): a graph with no CUDA tensor, or torch's 'cudagraphs' log filtered out; run with "
                    "TORCH_LOGS=cudagraphs to see torch's reason"
                ]
            )
        record(frames.messages)


class CompiledRunner:
    """``torch.compile(module, mode="reduce-overhead")`` as a runner; built by :func:`compiled`.

    Attributes: ``module``; ``compiled`` (the ``torch.compile`` result);
    ``skip_reasons`` (why torch ran CUDA graphs eagerly, deduplicated, in the
    order first seen, over every call and ``capture()``); ``calls``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dynamic: bool | None,
        clone_outputs: bool,
        make_inputs: Callable[[int, int], Mapping[str, Any]] | None,
        warmup_sizes: Sequence[int],
        max_num_reqs: int | None,
        warmup_calls: int,
        recompile_limit: int | None,
        compile_kwargs: Mapping[str, Any],
    ) -> None:
        self.module = module
        self.clone_outputs = clone_outputs
        self.make_inputs = make_inputs
        self.warmup_sizes = list(warmup_sizes)
        self.max_num_reqs = max_num_reqs
        self.warmup_calls = warmup_calls
        self.recompile_limit = recompile_limit
        self.skip_reasons: list[str] = []
        self.calls = 0
        # Dynamo caches compiled code on the *code object* it traces. Through
        # torch.compile(module) that is type(module).forward's code, shared by
        # every compiled instance of the class, with the same backend (torch
        # compares backends by their settings): a second runner on the class
        # would replay the first one's compiled graphs, and torch's skip
        # messages, logged once when a graph is compiled or first run, would
        # never reach it. Tracing module(**inputs) from a function whose code
        # object is this runner's own copy gives the runner its own dynamo
        # cache (inductor's on-disk caches still make the recompile cheap, and
        # a cache hit logs the skip again), so what it records is about its
        # own graphs. What is compiled is the module's call, as with
        # torch.compile(module).
        code = _call_module.__code__.replace(co_name=f"compiled_{type(module).__name__}")
        entry = types.FunctionType(code, _call_module.__globals__, code.co_name)
        kwargs = dict(compile_kwargs)
        if "options" in kwargs:
            # torch.compile takes a mode or options, not both: the mode's
            # options (CUDA graphs on), then the caller's.
            from torch._inductor import list_mode_options

            kwargs["options"] = {**list_mode_options("reduce-overhead"), **dict(kwargs["options"] or {})}
        else:
            kwargs["mode"] = "reduce-overhead"
        self.compiled: Callable[..., Any] = torch.compile(entry, dynamic=dynamic, **kwargs)

    @property
    def __name__(self) -> str:  # what verify_runner's report calls the runner
        return f"compiled({type(self.module).__name__})"

    def _record(self, messages: Iterable[str]) -> None:
        for msg in messages:
            if msg and msg not in self.skip_reasons:
                self.skip_reasons.append(msg)

    def _watch(self) -> Any:
        return skips_recorded(self._record)

    def _invoke(self, inputs: Mapping[str, Any]) -> Any:
        with ExitStack() as stack:
            stack.enter_context(self._watch())
            # An inference step: with grad enabled torch would compile a
            # training graph and, waiting for its backward, never start a new
            # CUDA-graph generation.
            stack.enter_context(torch.no_grad())
            if self.recompile_limit is not None:
                # dynamic=False compiles a graph per distinct input shape, and
                # a sweep of batch sizes meets more of them than dynamo's
                # default limit (8 a code object), past which it runs the
                # frame eagerly for good. The limit is read when dynamo
                # decides to compile, i.e. inside this call, and the frame is
                # this runner's own, so no other compiled code is affected.
                from torch._dynamo import config as dynamo_config

                stack.enter_context(dynamo_config.patch(recompile_limit=self.recompile_limit))
            # The inference loop torch documents (and transformers' generate
            # runs for compiled forwards): mark each step's start, so CUDA
            # graph trees treat every call as a new generation whatever the
            # grad mode; the previous step's outputs are then dead by
            # contract, which is the output hazard below.
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
            return self.compiled(self.module, dict(inputs))

    def capture(self) -> None:
        """Warm up and record the CUDA graphs of ``warmup_sizes`` (nothing without them).

        CUDA graph trees run a new graph's first call eagerly (warm-up) and
        record it on the second, so a runner called once per batch size
        would replay nothing; an engine warms its sizes up before serving,
        and so does this: ``warmup_calls`` calls on ``make_inputs(s,
        reqs(s))`` for each size ``s``, largest first.
        """
        if self.make_inputs is None:
            return
        # The warm-up batches are make_inputs' real-looking ones: what they
        # write (a KV cache's live slots) is no step of the caller's, so the
        # module's buffers are put back as they were (in place: the graphs
        # keep their addresses).
        with _buffers_copied_back(self.module):
            for size in sorted(self.warmup_sizes, reverse=True):
                reqs = size if self.max_num_reqs is None else min(size, self.max_num_reqs)
                inputs = self.make_inputs(size, reqs)
                for _ in range(self.warmup_calls):
                    self._invoke(inputs)
            torch.cuda.synchronize()

    def __call__(self, **inputs: Any) -> Any:
        self.calls += 1
        out = self._invoke(inputs)
        return _map_tensors(out, _clone) if self.clone_outputs else out


def _call_module(module: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    # The template each CompiledRunner copies the code of (see CompiledRunner.__init__).
    return module(**inputs)


def _check_module_on_cuda(what: str, module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{what}: module must be a torch.nn.Module; got {type(module).__name__}")
    off = sorted(
        {str(t.device) for t in (*module.parameters(), *module.buffers()) if t.device.type != "cuda"}
    )
    if off:
        raise ValueError(
            f"{what}: the module has parameters or buffers on {', '.join(off)}; CUDA graphs replay CUDA work "
            "only (torch.compile would silently skip them). Move the module first: module.cuda()"
        )


def compiled(
    module: torch.nn.Module,
    *,
    dynamic: bool | None = False,
    clone_outputs: bool = False,
    make_inputs: Callable[[int, int], Mapping[str, Any]] | None = None,
    warmup_sizes: Iterable[int] | None = None,
    max_num_reqs: int | None = None,
    warmup_calls: int = 3,
    recompile_limit: int | None = 64,
    **compile_kwargs: Any,
) -> CompiledRunner:
    """A runner that is ``torch.compile(module, mode="reduce-overhead", dynamic=dynamic, **compile_kwargs)``.

    Each call runs ``module(**inputs)`` compiled, under ``torch.no_grad()``,
    after ``torch.compiler.cudagraph_mark_step_begin()`` (one inference step
    a call), on the real batch as given: torch's CUDA graph trees record a
    graph for each input shape they meet and replay it from its next call on.

    Skips: torch.compile falls back to running a graph without CUDA graphs
    when it cannot graph it (mutated inputs, CPU tensors, incompatible ops,
    ...), saying so only in a log warning ("skipping cudagraphs due to ...").
    ``runner.skip_reasons`` lists torch's own messages, deduplicated, in
    order, from every call: read from the 'cudagraphs' logger of
    ``torch._inductor.cudagraph_utils`` and reconciled with
    ``counters["inductor"]["cudagraph_skips"]`` (a skip counted but not
    logged is recorded as such), plus dynamo's warnings that it ran a frame
    eagerly. ``verify_runner``'s graph_coverage check reports them.

    Outputs: CUDA graph trees return tensors that live in the graphs' memory
    pool, and the next call (the next step) overwrites them: a replay writes
    the next batch's values into them in silence, and where torch has freed
    them (a new generation after a recording) reading one raises its
    RuntimeError "accessing tensor output of CUDAGraphs that has been
    overwritten by a subsequent run". The runner returns outputs as
    torch.compile does, so that ``verify_runner``'s output_lifetime check can
    report this; ``clone_outputs=True`` returns clones, the fix torch's
    message gives (cloning outside torch.compile).

    ``capture()`` warms up and records ``warmup_sizes`` (token counts, each
    on ``make_inputs(s, min(s, max_num_reqs))``, ``warmup_calls`` calls
    each): CUDA graph trees run a shape's first call eagerly and record on
    the second, so without a warm-up the first call of every batch size
    replays nothing. With ``dynamic=False`` (the default) each token count
    is its own graph; warm up every count the runner will serve. With
    ``dynamic=True`` a recompile after the warm-up makes a new graph that
    serves the later calls, and their shapes warm up afresh (dynamo tries
    its newest graph first): a warm-up whose batches all had as many tokens
    as requests gets a graph that assumes so, and the first batch with more
    tokens than requests recompiles. ``recompile_limit``
    (default 64; None: torch's own, 8) is dynamo's recompile limit during
    this runner's calls, as each shape is a recompile under ``dynamic=False``.

    ``compile_kwargs`` go to torch.compile; ``options`` are added to
    reduce-overhead's (torch.compile refuses a mode and options together).
    Raises RuntimeError without a CUDA device and ValueError for a module
    not on CUDA.
    """
    _require_cuda("compiled()")
    _check_module_on_cuda("compiled()", module)
    if (make_inputs is None) != (warmup_sizes is None):
        raise ValueError(
            "compiled(): give make_inputs and warmup_sizes together (capture() warms up each size "
            "on make_inputs(size, num_reqs)), or neither"
        )
    if make_inputs is not None and not callable(make_inputs):
        raise ValueError(
            f"compiled(): make_inputs must be a function (num_tokens, num_reqs) -> dict of inputs; "
            f"got {type(make_inputs).__name__}"
        )
    sizes = (
        int_list("compiled(): warmup_sizes", warmup_sizes, what="token counts")
        if warmup_sizes is not None
        else []
    )
    optional_int("compiled(): max_num_reqs", max_num_reqs)
    optional_int("compiled(): recompile_limit", recompile_limit)
    if not isinstance(warmup_calls, int) or isinstance(warmup_calls, bool) or warmup_calls < 2:
        raise ValueError(
            f"compiled(): warmup_calls must be an int >= 2 (a warm-up call, then the one that "
            f"records the graph); got {warmup_calls!r}"
        )
    if "mode" in compile_kwargs:
        raise ValueError(
            "compiled(): mode is 'reduce-overhead' (CUDA graph trees); for another mode call "
            "torch.compile yourself and verify that callable"
        )
    return CompiledRunner(
        module,
        dynamic=dynamic,
        clone_outputs=clone_outputs,
        make_inputs=make_inputs,
        warmup_sizes=sizes,
        max_num_reqs=max_num_reqs,
        warmup_calls=warmup_calls,
        recompile_limit=recompile_limit,
        compile_kwargs=compile_kwargs,
    )


# ---------------------------------------------------------------------------
# torch.cuda.make_graphed_callables
# ---------------------------------------------------------------------------


@dataclass
class _SizeGraph:
    """One capture size's graphed callable and the static input tensors it reads."""

    size: int
    reqs: int
    fn: Callable[..., Any]
    static: dict[str, torch.Tensor]  # make_graphed_callables' sample args, by input name (the graph's inputs)


def _positional(module: torch.nn.Module, names: Sequence[str]) -> Callable[..., Any]:
    """``module`` called positionally: make_graphed_callables passes its sample args by position only."""
    keys = tuple(names)

    def forward(*args: torch.Tensor) -> Any:
        return module(**dict(zip(keys, args, strict=True)))

    return forward


class GraphedRunner:
    """``torch.cuda.make_graphed_callables`` per capture size as a runner; built by :func:`graphed_callables`."""

    def __init__(
        self,
        module: torch.nn.Module,
        make_inputs: Callable[[int, int], Mapping[str, Any]],
        capture_sizes: Sequence[int],
        *,
        max_num_reqs: int | None,
        pad_values: Mapping[str, Any],
        num_warmup_iters: int,
    ) -> None:
        self.module = module
        self.make_inputs = make_inputs
        self.capture_sizes = list(capture_sizes)
        self.max_num_reqs = max_num_reqs
        self.pad_values = dict(pad_values)
        self.num_warmup_iters = num_warmup_iters
        self.graphs: dict[int, _SizeGraph] = {}
        self.token_input: str | None = None  # the input whose dim 0 is the batch's token count
        self.eager_calls = 0
        self.graph_calls = 0

    @property
    def __name__(self) -> str:
        return f"graphed_callables({type(self.module).__name__})"

    def reqs(self, num_tokens: int) -> int:
        """Requests in a batch of ``num_tokens`` tokens, as the capture and ``verify_runner`` draw them."""
        return num_tokens if self.max_num_reqs is None else min(num_tokens, self.max_num_reqs)

    def _sample(self, size: int) -> dict[str, torch.Tensor]:
        inputs = self.make_inputs(size, self.reqs(size))
        if not isinstance(inputs, Mapping):
            raise ValueError(
                f"graphed_callables: make_inputs must return a dict of keyword inputs; got "
                f"{type(inputs).__name__}"
            )
        others = [k for k, v in inputs.items() if not isinstance(v, torch.Tensor)]
        if others:
            raise ValueError(
                f"graphed_callables: make_inputs({size}, {self.reqs(size)}) gave inputs that are not tensors "
                f"({', '.join(others)}); make_graphed_callables graphs tensor arguments only (a Python value "
                "would be frozen into the graph). Pass them as tensors, or bind them into the module"
            )
        off = [k for k, v in inputs.items() if v.device.type != "cuda"]
        if off:
            raise ValueError(
                f"graphed_callables: make_inputs({size}, {self.reqs(size)}) gave inputs off the GPU "
                f"({', '.join(off)}); build them on the module's CUDA device"
            )
        # Detached: the sample tensors become the graph's static inputs, and
        # an input requiring grad would have make_graphed_callables build the
        # autograd graph an inference runner never uses.
        return {k: v.detach() for k, v in inputs.items()}

    def capture(self) -> None:
        """Build a graphed callable for each capture size, largest first, in one memory pool.

        Runs the module ``num_warmup_iters`` times and once more in the
        capture on each size's sample batch, under ``torch.no_grad()``; the
        module's buffers (a KV cache those batches write) are put back as
        they were afterwards.
        """
        _require_cuda("graphed_callables()")
        samples = {s: self._sample(s) for s in self.capture_sizes}
        self.token_input = self._find_token_input(samples)
        # One pool for every size, as an engine does: each graph's static
        # outputs and inputs stay allocated (held here), so a later capture
        # reuses only the earlier ones' freed intermediates, and graphs of one
        # runner never run at once. Largest first, so that the smaller ones
        # fit in what it freed.
        pool = torch.cuda.graph_pool_handle()
        self.graphs = {}
        # No grad: the warm-up and capture skip the backward graph
        # make_graphed_callables records for training (no output requires
        # grad), and no parameter enters the graph's autograd surface, since
        # a function, not the module, is graphed (nor is the module's forward
        # replaced, as make_graphed_callables does to a module it is given).
        # allow_unused_input only matters to the autograd.grad calls this
        # skips; True so that an input the forward ignores is never an error.
        # The sample batches' writes (a KV cache's live slots) are put back
        # afterwards, in place, as compiled()'s warm-ups are.
        with torch.no_grad(), _buffers_copied_back(self.module):
            for size in sorted(self.capture_sizes, reverse=True):
                static = samples[size]
                fn = torch.cuda.make_graphed_callables(
                    _positional(self.module, list(static)),
                    tuple(static.values()),
                    num_warmup_iters=self.num_warmup_iters,
                    allow_unused_input=True,
                    pool=pool,
                )
                self.graphs[size] = _SizeGraph(size, self.reqs(size), fn, static)
        torch.cuda.synchronize()

    def _find_token_input(self, samples: Mapping[int, Mapping[str, torch.Tensor]]) -> str:
        """The first input (in make_inputs' order) with ``size`` rows at every capture size."""
        first = samples[self.capture_sizes[0]]
        for name in first:
            if all(v[name].dim() > 0 and v[name].shape[0] == s for s, v in samples.items()):
                return name
        shapes = {s: {k: tuple(t.shape) for k, t in v.items()} for s, v in samples.items()}
        raise ValueError(
            "graphed_callables: no input has num_tokens rows (dim 0) at every capture size, so the runner cannot "
            f"tell a batch's token count; make_inputs gave {shapes}. Per-token inputs must have the batch "
            "along dim 0"
        )

    def _load(self, graph: _SizeGraph, inputs: Mapping[str, Any]) -> None:
        """Copy the real batch into the graph's static inputs; rows past it get the pad value."""
        missing = sorted(set(graph.static) - set(inputs))
        extra = sorted(set(inputs) - set(graph.static))
        if missing or extra:
            raise ValueError(
                f"graphed_callables: the batch's inputs differ from the captured ones (missing "
                f"{missing}, not captured {extra}); call the runner with make_inputs' keywords"
            )
        for name, static in graph.static.items():
            real = inputs[name]
            if not isinstance(real, torch.Tensor):
                raise ValueError(
                    f"graphed_callables: input {name!r} is a {type(real).__name__}, captured as a tensor"
                )
            if real.shape == static.shape:
                static.copy_(real)
                continue
            rows = real.shape[0] if real.dim() else -1
            if (
                real.dim() != static.dim()
                or real.shape[1:] != static.shape[1:]
                or not 0 <= rows <= static.shape[0]
            ):
                raise ValueError(
                    f"graphed_callables: input {name!r} of shape {tuple(real.shape)} does not fit the graph of "
                    f"{graph.size} tokens, captured with shape {tuple(static.shape)}: only dim 0 may be smaller "
                    "(the rows the runner pads)"
                )
            static[:rows].copy_(real)
            pad = self.pad_values.get(name, 0)
            if pad == EDGE and rows > 0:
                static[rows:].copy_(real[-1:].expand_as(static[rows:]))
            else:
                static[rows:].fill_(0 if pad == EDGE else pad)

    def __call__(self, **inputs: Any) -> Any:
        if not self.graphs or self.token_input is None:
            raise RuntimeError(
                "graphed_callables: call runner.capture() before the first batch (verify_runner "
                "does); it builds a graph for each capture size"
            )
        token_input = inputs.get(self.token_input)
        if not isinstance(token_input, torch.Tensor) or token_input.dim() == 0:
            raise ValueError(
                f"graphed_callables: the batch has no tensor {self.token_input!r} with its tokens "
                "along dim 0 (the input that gives a batch's token count)"
            )
        num_tokens = int(token_input.shape[0])
        size = next((s for s in sorted(self.graphs) if s >= num_tokens), None)
        if size is None:  # past the largest graph: the module, eagerly, on the real batch
            self.eager_calls += 1
            with torch.no_grad():
                return self.module(**inputs)
        graph = self.graphs[size]
        self._load(graph, inputs)
        self.graph_calls += 1
        with torch.no_grad():
            out = graph.fn(*graph.static.values())
        reqs = self.reqs(num_tokens)

        def cut(t: torch.Tensor) -> torch.Tensor:
            # Rows per token are the graph's size; rows per request, its
            # requests (the same count when size <= max_num_reqs, and then the
            # batch has as many requests as tokens). Others are whole.
            if t.dim() and t.shape[0] == graph.size:
                t = t[:num_tokens]
            elif t.dim() and t.shape[0] == graph.reqs:
                t = t[:reqs]
            # The graph's outputs are its static memory: the next replay
            # overwrites them, so the caller gets copies.
            return t.detach().clone()

        return _map_tensors(out, cut)


def graphed_callables(
    module: torch.nn.Module,
    make_inputs: Callable[[int, int], Mapping[str, Any]],
    capture_sizes: Iterable[int],
    *,
    max_num_reqs: int | None = None,
    pad_values: Mapping[str, Any] | None = None,
    num_warmup_iters: int = 3,
) -> GraphedRunner:
    """A runner of ``torch.cuda.make_graphed_callables`` graphs, one per capture size.

    ``capture()`` graphs ``module`` for each size ``s`` with sample args
    ``make_inputs(s, reqs(s))`` (``reqs(s)`` is ``s``, or ``min(s,
    max_num_reqs)``), in one memory pool. make_graphed_callables takes
    positional tensor args and is built for training: the runner graphs a
    function that passes them to ``module`` by keyword, under
    ``torch.no_grad()`` (no backward graph, no autograd on the outputs).

    ``runner(**inputs)`` on a real batch: its token count is dim 0 of the
    first input (in make_inputs' order) that has ``s`` rows at every capture
    size ``s`` (the per-token inputs have the batch along dim 0; per-request
    inputs follow the request count). It picks the smallest size that holds
    the batch, copies each input into the graph's static input and fills the
    rows past it with ``pad_values[name]`` (default 0; ``"edge"`` repeats the
    last real row), replays, and returns clones of the outputs cut to the
    real rows: an output with ``s`` rows is cut to the token count, one with
    ``reqs(s)`` rows to ``reqs(num_tokens)`` (the batch is assumed to have as
    many requests as make_inputs gives for its token count), other outputs
    are returned whole. Tensors, tuples, lists and dicts of them. A batch
    larger than every size runs ``module`` eagerly.

    Raises RuntimeError without a CUDA device (here and in ``capture()``).
    """
    _require_cuda("graphed_callables()")
    _check_module_on_cuda("graphed_callables()", module)
    if not callable(make_inputs):
        raise ValueError(
            f"graphed_callables(): make_inputs must be a function (num_tokens, num_reqs) -> dict of "
            f"inputs; got {type(make_inputs).__name__}"
        )
    sizes = int_list("graphed_callables(): capture_sizes", capture_sizes, what="token counts")
    if not sizes:
        raise ValueError("graphed_callables(): capture_sizes is empty; give the token counts to graph")
    optional_int("graphed_callables(): max_num_reqs", max_num_reqs)
    optional_int("graphed_callables(): num_warmup_iters", num_warmup_iters)
    return GraphedRunner(
        module,
        make_inputs,
        sizes,
        max_num_reqs=max_num_reqs,
        pad_values=pad_values or {},
        num_warmup_iters=num_warmup_iters,
    )
