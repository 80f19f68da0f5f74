"""The one YAML loader for what users and operators hand Strata: job files, ``--set`` values.

``yaml.safe_load`` builds no objects of the file's choosing, but it still lets a file do harm:
aliases share nodes cheaply, and whatever walks the result later (a copy, a validator, JSON)
expands them, so 353 bytes can cost hours. It also keeps the last of two equal keys silently and
turns ``2024-01-01`` into a date. :func:`load` refuses those cases and names the line:

- every alias is counted as the size of what it expands to (memoized per node, so counting is
  linear in the file), and a document past ``max_nodes`` nodes is refused at the alias (or node)
  that crosses the bound; an alias to a node that contains it is refused too;
- nesting past ``max_depth`` levels is refused (aliases count as what they expand to), before
  anything recursive could run out of stack;
- a key given twice in one mapping is refused (keys a merge ``<<`` brings in may be overridden
  by the mapping's own, as YAML defines);
- no timestamps: ``2024-01-01`` stays text; tags that make what JSON cannot hold (``!!binary``,
  ``!!set``, ``!!omap``, ``!!pairs``, ``!!timestamp``) are refused.

libyaml's event parser is used where PyYAML was built with it: it reads a 16 MiB comment or
scalar in a tenth of a second, PyYAML's Python scanner in 4 to 20. Composing and constructing
stay in Python (here), so the bounds above hold with either parser.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

#: nodes in a document with every alias expanded; a job file has a few hundred
MAX_NODES = 100_000
#: levels of nesting, a scalar counting as one (``strata.spec.MAX_SPEC_DEPTH``)
MAX_DEPTH = 32
#: characters of a key or value quoted back in a message
QUOTE_CHARS = 64

_MERGE = "tag:yaml.org,2002:merge"
_VALUE = "tag:yaml.org,2002:value"
_STR = "tag:yaml.org,2002:str"
#: tags whose values JSON cannot hold: a file Strata reads is mappings, lists and scalars
_NOT_JSON = ("timestamp", "binary", "set", "omap", "pairs")


class YamlRefused(ValueError):
    """A text :func:`load` will not load. ``message`` names the source and (where known) the
    line; ``problem`` is the same without them, for callers that name the source their way."""

    def __init__(self, message: str, line: int, problem: str = ""):
        super().__init__(message)
        self.message = message
        #: 1-based; 0 where no line applies
        self.line = line
        self.problem = problem or message


def quote(value: Any) -> str:
    """A key or value as a message shows it: quoted, at most ``QUOTE_CHARS`` characters."""
    text = value if isinstance(value, str) else str(value)
    return repr(text[:QUOTE_CHARS]) + ("..." if len(text) > QUOTE_CHARS else "")


def _refusal(source: str, mark: Any, problem: str) -> YamlRefused:
    line = mark.line + 1 if mark is not None else 0
    where = f"{source} line {line}" if line else source
    return YamlRefused(f"{where}: {problem}", line, problem)


class _Composer(Composer):  # type: ignore[misc]
    """PyYAML's composer, counting as it goes: nodes (aliases as what they expand to), depth,
    and each mapping's keys."""

    def _bound(self, source: str, max_nodes: int, max_depth: int) -> None:
        self._source = source
        self._max_nodes = max_nodes
        self._max_depth = max_depth
        self._nodes = 0  # the document so far, every alias expanded
        self._level = 0  # nesting of the node being composed
        self._heights: list[int] = []  # per open collection: its tallest child so far
        #: per anchored node: its expanded size and height; absent while it is being composed
        self._sizes: dict[Node, tuple[int, int]] = {}
        #: per open mapping: (tag, text) of each scalar key -> the line it was given on
        self._keys: dict[Node, dict[tuple[str, str], int]] = {}

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            node = self._alias(event)
        else:
            node = self._new_node(event, parent, index)
        if isinstance(parent, MappingNode) and index is None:
            self._key(parent, node, event.start_mark)
        return node

    def _refuse(self, mark: Any, problem: str) -> YamlRefused:
        return _refusal(self._source, mark, problem)

    def _alias(self, event: Any) -> Node:
        target = self.anchors.get(event.anchor)
        if target is None:
            return super().compose_node(None, None)  # PyYAML's "undefined alias", with its line
        known = self._sizes.get(target)
        if known is None:
            raise self._refuse(event.start_mark, f"alias *{event.anchor} is inside the node it "
                                                 "names: a structure that never ends")
        size, height = known
        self._nodes += size
        if self._nodes > self._max_nodes:
            raise self._refuse(event.start_mark, f"alias *{event.anchor} makes the document more "
                                                 f"than {self._max_nodes:,} nodes with every alias "
                                                 "expanded, as whatever reads it expands them")
        self._grow(height, event.start_mark)
        self.get_event()
        return target

    def _new_node(self, event: Any, parent: Node | None, index: Any) -> Node:
        before = self._nodes
        self._nodes += 1
        if self._nodes > self._max_nodes:
            raise self._refuse(event.start_mark, f"more than {self._max_nodes:,} nodes: too "
                                                 "large for a file of settings")
        if self._level + 1 > self._max_depth:
            raise self._refuse(event.start_mark, f"nested too deeply: more than "
                                                 f"{self._max_depth} levels deep")
        self._level += 1
        self._heights.append(0)
        node: Node = super().compose_node(parent, index)
        height = self._heights.pop() + 1
        self._level -= 1
        self._grow(height, event.start_mark)
        self._keys.pop(node, None)
        if event.anchor is not None:
            self._sizes[node] = (self._nodes - before, height)
        return node

    def _grow(self, height: int, mark: Any) -> None:
        """Notes a child ``height`` levels tall under the open collection."""
        if self._level + height > self._max_depth:
            raise self._refuse(mark, f"nested too deeply: more than {self._max_depth} levels "
                                     "deep with its aliases expanded")
        if self._heights:
            self._heights[-1] = max(self._heights[-1], height)

    def _key(self, mapping: Node, key: Node, mark: Any) -> None:
        """Refuses a scalar key given twice, as it is composed (equal keys written differently,
        ``1`` and ``0x1``, are the constructor's to find)."""
        if not isinstance(key, ScalarNode):
            return
        seen = self._keys.setdefault(mapping, {})
        first = seen.get((key.tag, key.value))
        if first is not None:
            raise self._refuse(mark, _duplicate(key.value, first))
        seen[(key.tag, key.value)] = mark.line + 1


def _duplicate(key: Any, first: int) -> str:
    return (f"key {quote(key)} is given twice in one mapping (first on line {first}); YAML would "
            "keep only the last, so say it once")


class _Constructor(SafeConstructor):  # type: ignore[misc]
    """PyYAML's safe constructor, refusing equal keys and what JSON cannot hold, with merges
    as YAML defines them."""

    _source: str  # set by _Composer._bound

    def _start(self) -> None:
        #: per flattened mapping: how many of its pairs came from merges (they lead the list)
        self._merged: dict[Node, int] = {}

    def _refuse(self, mark: Any, problem: str) -> YamlRefused:
        return _refusal(self._source, mark, problem)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (YamlRefused, yaml.YAMLError):
            raise
        except (ValueError, TypeError, ArithmeticError) as e:  # e.g. an int of 5,000 digits
            raise self._refuse(node.start_mark, str(e)[:200]) from None

    def flatten_mapping(self, node: MappingNode) -> None:
        """Puts the pairs merges bring in (``<<: *a`` or ``<<: [*a, *b]``) ahead of the
        mapping's own, so that its own win and, among the merged, earlier mappings win
        (YAML's merge key). Each mapping is flattened once; the count of merged pairs is kept
        for :meth:`construct_mapping`."""
        if node in self._merged:
            return
        own = []
        sources: list[Node] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE:
                if key_node.tag == _VALUE:
                    key_node.tag = _STR
                own.append((key_node, value_node))
                continue
            items = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for item in items:
                if not isinstance(item, MappingNode):
                    raise ConstructorError("while constructing a mapping", node.start_mark,
                                           "expected a mapping or list of mappings for "
                                           f"merging, but found {item.id}", item.start_mark)
                sources.append(item)
        merged = []
        for source in reversed(sources):  # the earliest source last: its keys win
            self.flatten_mapping(source)
            merged.extend(source.value)
        node.value = merged + own
        self._merged[node] = len(merged)

    def construct_mapping(self, node: Node, deep: bool = False) -> Any:
        if isinstance(node, MappingNode):
            self.flatten_mapping(node)
            seen: dict[Any, Node] = {}
            for key_node, _ in node.value[self._merged[node]:]:
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.get(key)
                except TypeError:
                    break  # unhashable: PyYAML's own error says so, with the line
                if first is not None:
                    raise self._refuse(key_node.start_mark,
                                       _duplicate(key, first.start_mark.line + 1))
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)

    def _not_json(self, node: Node) -> Any:
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        hint = "; quote a date to keep it as text" if tag == "!!timestamp" else ""
        raise self._refuse(node.start_mark, f"{tag} makes a value JSON cannot hold: this file "
                                            "takes mappings, lists, strings, numbers, true/false "
                                            f"and null{hint}")


for _name in _NOT_JSON:
    _Constructor.add_constructor(f"tag:yaml.org,2002:{_name}", _Constructor._not_json)


class _Resolver(Resolver):  # type: ignore[misc]
    """PyYAML's resolver less timestamps: ``2024-01-01`` stays the text it looks like."""


_Resolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in Resolver.yaml_implicit_resolvers.items()
}


class _PyLoader(Reader, Scanner, Parser, _Composer, _Constructor, _Resolver):  # type: ignore[misc]
    def __init__(self, text: str):
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        _Composer.__init__(self)
        _Constructor.__init__(self)
        _Resolver.__init__(self)


_LOADERS: list[type] = [_PyLoader]
try:
    from yaml.cyaml import CParser

    class _CLoader(_Composer, CParser, _Constructor, _Resolver):  # type: ignore[misc]
        """libyaml's parser for the events; this module's composer and constructor."""

        def __init__(self, text: str):
            CParser.__init__(self, text)
            _Composer.__init__(self)
            _Constructor.__init__(self)
            _Resolver.__init__(self)

    _LOADERS.insert(0, _CLoader)
except ImportError:  # PyYAML built without libyaml: the same rules, parsed in Python
    pass

#: the loader :func:`load` uses (tests run each)
LOADERS = tuple(_LOADERS)


def load(text: str, source: str, *, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH,
         loader: type | None = None) -> Any:
    """One YAML document from ``text``, as mappings, lists, strings, numbers, booleans and
    None. ``source`` names it in messages (a path, ``--set name``).

    Raises:
        YamlRefused: naming ``source`` and the line: not YAML, aliases that expand past
            ``max_nodes``, nesting past ``max_depth``, a key given twice, a tag JSON cannot
            hold, a character YAML does not allow.
    """
    bad = Reader.NON_PRINTABLE.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        problem = (f"character {ord(bad.group()):#06x} is not allowed in YAML text (control "
                   "characters and lone surrogates)")
        raise YamlRefused(f"{source} line {line}: {problem}", line, problem)
    ld = None
    try:
        ld = (loader or LOADERS[0])(text)
        ld._bound(source, max_nodes, max_depth)
        ld._start()
        return ld.get_single_data()
    except YamlRefused:
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = " ".join(str(e.problem or e.context or "not valid YAML").split())
        if "maximum nesting depth" in problem:  # libyaml's own bound (1,000), met scanning ahead
            problem = f"nested too deeply: more than {max_depth} levels deep"
            raise _refusal(source, mark, problem) from None
        if e.context and e.problem:
            context = " ".join(str(e.context).split())
            cmark = e.context_mark
            if cmark is not None and mark is not None and cmark.line != mark.line:
                context += f" from line {cmark.line + 1}"
            problem = f"{context}: {problem}"
        raise _refusal(source, mark, f"not valid YAML: {problem}"[:300]) from None
    except yaml.YAMLError as e:  # a reader error: no line of its own
        raise YamlRefused(f"{source}: not valid YAML: {str(e)[:200]}", 0) from None
    except RecursionError:  # the depth bound comes first; this is a last line of defence
        raise YamlRefused(f"{source}: nested too deeply", 0) from None
    finally:
        if ld is not None:
            ld.dispose()
