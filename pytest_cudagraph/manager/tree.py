"""Walking a forward's output: its leaves, where each sits, and the same structure rebuilt.

torch's pytree knows tensors, tuples, lists, dicts, namedtuples and the types
registered with it (transformers registers its ``ModelOutput`` classes, None
fields left out and put back as None). A plain ``@dataclass`` is not
registered, and pytree would hand it over as one opaque leaf: its tensors
would be neither cut to the real rows nor compared. Registering the user's
class with pytree would change it for the whole process (``torch.export``,
``torch.compile``, other libraries), so its fields are walked here instead and
the instance is rebuilt as a shallow copy with its fields replaced, which
works for frozen dataclasses and ``init=False`` fields alike and does not run
``__post_init__`` again.

A tree with no such dataclass in it is taken apart and rebuilt by pytree
itself: the common outputs cost on ``run()`` exactly what they cost before.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["Structure", "flatten", "flatten_with_paths", "leaves", "tree_map", "unflatten"]

KeyPath = tuple[Any, ...]


def _node_type(tree: Any) -> Any:
    # pytree files every namedtuple under ``namedtuple``, not its own class.
    get = getattr(pytree, "_get_node_type", None)
    return get(tree) if get is not None else type(tree)


def _is_plain_dataclass(value: Any) -> bool:
    """A dataclass instance pytree does not know (a class object is a leaf)."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and _node_type(value) not in pytree.SUPPORTED_NODES
    )


class _Node:
    """One inner node of a walked tree: how to rebuild it from its children."""

    __slots__ = ("children", "context", "node_def", "template")

    def __init__(self, node_def: Any, context: Any, template: Any, children: list[_Node | None]) -> None:
        self.node_def = node_def  # pytree's NodeDef, or None for a plain dataclass
        self.context = context  # pytree's context, or the dataclass's field names
        self.template = template  # the dataclass instance copied on rebuild
        self.children = children  # None marks a leaf

    def build(self, leaves: Any) -> Any:
        values = [next(leaves) if child is None else child.build(leaves) for child in self.children]
        if self.node_def is not None:
            return self.node_def.unflatten_fn(values, self.context)
        rebuilt = copy.copy(self.template)
        for name, value in zip(self.context, values, strict=True):
            object.__setattr__(rebuilt, name, value)  # frozen dataclasses too
        return rebuilt


class Structure:
    """How to put a tree back together from its leaves: ``structure.unflatten(leaves)``."""

    __slots__ = ("num_leaves", "unflatten")

    def __init__(self, unflatten: Callable[[list[Any]], Any], num_leaves: int) -> None:
        # Bound once: on run()'s path the rebuild is this one call.
        self.unflatten = unflatten
        self.num_leaves = num_leaves


def _walk(tree: Any, path: KeyPath, out: list[tuple[KeyPath, Any]], active: set[int]) -> _Node | None:
    """Append (key path, leaf) pairs of ``tree`` to ``out``; the node to rebuild it, None for a leaf."""
    node_def = pytree.SUPPORTED_NODES.get(_node_type(tree))
    if node_def is not None:
        if node_def.flatten_with_keys_fn is not None:
            keyed, context = node_def.flatten_with_keys_fn(tree)
        else:  # a type registered without keys: positions stand in
            children, context = node_def.flatten_fn(tree)
            keyed = [(pytree.SequenceKey(i), c) for i, c in enumerate(children)]
        template = None
    elif _is_plain_dataclass(tree) and id(tree) not in active:
        names = [f.name for f in dataclasses.fields(tree)]
        keyed = [(pytree.GetAttrKey(n), getattr(tree, n)) for n in names]
        node_def, context, template = None, names, tree
    else:
        out.append((path, tree))
        return None
    active.add(id(tree))  # a dataclass that holds itself is a leaf the second time
    try:
        nodes = [_walk(child, (*path, key), out, active) for key, child in keyed]
    finally:
        active.discard(id(tree))
    return _Node(node_def, context, template, nodes)


def _walked(tree: Any) -> tuple[list[tuple[KeyPath, Any]], Structure]:
    out: list[tuple[KeyPath, Any]] = []
    root = _walk(tree, (), out, set())
    if root is None:
        return out, Structure(lambda leaves: leaves[0], 1)
    node = root

    def unflatten(leaves: list[Any]) -> Any:
        if len(leaves) != len(out):
            raise ValueError(f"the structure holds {len(out)} leaves; got {len(leaves)}")
        return node.build(iter(leaves))

    return out, Structure(unflatten, len(out))


def flatten(tree: Any) -> tuple[list[Any], Structure]:
    """The leaves of ``tree`` (dataclass fields included) and how to rebuild it."""
    flat, spec = pytree.tree_flatten(tree)
    if not any(_is_plain_dataclass(leaf) for leaf in flat):
        return flat, Structure(spec.unflatten, len(flat))
    walked, structure = _walked(tree)
    return [leaf for _, leaf in walked], structure


def unflatten(leaves: list[Any], structure: Structure) -> Any:
    return structure.unflatten(list(leaves))


def leaves(tree: Any) -> list[Any]:
    return flatten(tree)[0]


def flatten_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """(readable path, leaf) pairs: ``['logits']`` for a mapping key, ``[1]`` for a
    position, ``.logits`` for a dataclass or namedtuple field; ``""`` for a bare leaf."""
    # Our own walk, always: the same keys pytree gives, and no failure on a
    # type registered without keys (compared, not on run()'s path).
    walked, _ = _walked(tree)
    return [(pytree.keystr(path), leaf) for path, leaf in walked]


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` rebuilt with ``fn`` applied to every leaf."""
    flat, structure = flatten(tree)
    return structure.unflatten([fn(leaf) for leaf in flat])
