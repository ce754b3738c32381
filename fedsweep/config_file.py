"""Reading a config file: bytes → UTF-8 text → one YAML mapping, with every way that can go wrong reported
as bad input (:class:`ConfigFileError`) naming the file and line, and bounded in time and memory.

What plain ``yaml.safe_load`` lets through, and this refuses:

- a key given twice in one mapping (``safe_load`` keeps the last silently: a whole section can vanish);
- a document whose aliases expand to more than :data:`MAX_VALUES` values (a "billion laughs" file is
  small, its expansion is not: every walk over the tree - ours, pydantic's - would expand it);
- nesting deeper than :data:`MAX_DEPTH` (PyYAML's composer recurses once per level, and its scanner's work grows
  with the square of the depth of ``[``/``{`` nesting: 3000 levels took 1.3 s to reach a RecursionError, so the
  scanner stops at the first bracket past the limit);
- a file over :data:`MAX_BYTES`, or one that is not UTF-8 text.

And it reads ``1e-3`` as the number YAML 1.2 says it is (YAML 1.1's resolver, PyYAML's, wants a dot:
``1.0e-3``), so that strict validation can refuse strings where numbers belong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_VALUES = 100_000
MAX_DEPTH = 64


class ConfigFileError(ValueError):
    """A file that cannot be read as a config: one problem, already prefixed with ``file[:line]``."""


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key_node.value!r} given twice (first on line {seen[key]}); give it once",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep)

    def fetch_flow_collection_start(self, TokenClass):
        if self.flow_level >= MAX_DEPTH:
            raise ConfigFileError(f":{self.line + 1}: YAML nested deeper than {MAX_DEPTH} levels")
        super().fetch_flow_collection_start(TokenClass)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _expanded_size(root: yaml.Node) -> int:
    """How many values the document becomes once every alias is expanded (shared nodes counted once
    per reference, computed once each), refusing nesting deeper than :data:`MAX_DEPTH`."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if depth > MAX_DEPTH:
            raise ConfigFileError(f":{node.start_mark.line + 1}: YAML nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v, depth + 1) for v in node.value)
        else:
            n = 1
        sizes[id(node)] = min(n, MAX_VALUES + 1)
        return sizes[id(node)]

    return size(root, 0)


def _line_index(root: yaml.Node | None) -> dict[tuple, int]:
    """Each key path of the document → its 1-based line number."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else None
                lines.setdefault(path + (key,), k.start_mark.line + 1)
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def read(path: str | Path) -> tuple[dict[str, Any], str, dict[tuple, int]]:
    """The file's top-level mapping, its text, and the line of each key path."""
    p = Path(path)
    if p.is_dir():
        raise ConfigFileError(f"{p}: is a directory; give a YAML file")
    if not p.exists():
        raise ConfigFileError(f"{p}: no such file")
    try:
        if p.stat().st_size > MAX_BYTES:
            raise ConfigFileError(f"{p}: {p.stat().st_size} bytes; a config file is at most {MAX_BYTES} bytes")
        data = p.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"{p}: cannot be read: {e.strerror or e}") from None
    try:
        source = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigFileError(f"{p}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); save the file as UTF-8") from None
    loader = None
    try:
        loader = _Loader(source)  # checks that every character is printable
        root = loader.get_single_node()
        if root is not None and _expanded_size(root) > MAX_VALUES:
            raise ConfigFileError(f":{root.start_mark.line + 1}: the YAML expands to more than {MAX_VALUES} values (aliases?)")
        value = loader.construct_document(root) if root is not None else None
    except ConfigFileError as e:
        raise ConfigFileError(f"{p}{e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else source[: getattr(e, "position", 0)].count("\n") + 1
        raise ConfigFileError(f"{p}:{line}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise ConfigFileError(f"{p}: YAML nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(value, dict):
        raise ConfigFileError(f"{p}: expected a mapping of config fields at the top level, got {type(value).__name__}")
    return value, source, _line_index(root)
