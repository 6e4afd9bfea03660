"""Reading a job file: its size, its YAML, and keys given twice.

`read_job_file` is the first half of `JobSpec.from_yaml`: it turns a path into the plain
data the spec validates, or a `SpecError` naming the file. A job file is a page of
settings, so one over 1 MiB is refused before it is parsed (a 50 MB file once took 13 s
to be accepted); plain YAML keeps the last of two equal keys, so a key given twice is
refused with both lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import SpecError

MAX_JOB_FILE_BYTES = 2**20  # 1 MiB


def read_job_file(path: Path) -> Any:
    """The YAML document in `path`, or SpecError: not found, unreadable, too big, a duplicate key, bad YAML."""
    source = str(path)
    try:
        with path.open("rb") as f:  # at most one byte over the limit, whatever the file's size
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
        if len(raw) > MAX_JOB_FILE_BYTES:
            size = path.stat().st_size if path.is_file() else len(raw)
            raise SpecError(source, [("", f"job file is {size:,} bytes; the limit is 1 MiB "
                                          f"({MAX_JOB_FILE_BYTES:,} bytes)")])
        text = raw.decode()
    except FileNotFoundError:
        raise SpecError(source, [("", "file not found")]) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise SpecError(source, [("", f"cannot read the file: {e}")]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except DuplicateKeyError as e:
        raise SpecError(source, [(e.path, str(e))]) from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(source, [("", f"invalid YAML{where}: {problem}")]) from None
    return data


class DuplicateKeyError(ValueError):
    """A key given twice in one YAML mapping; `path` is the field path of the mapping's key."""

    def __init__(self, path: str, key: str, first_line: int, second_line: int):
        self.path = path
        super().__init__(f"duplicate key {key!r} at lines {first_line} and {second_line} (YAML would silently keep "
                         "the last); give it once")


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in any mapping, at any depth.

    Plain YAML keeps the last of two equal keys, so a job file that sets `steps` twice
    runs with whichever came later. The check walks the composed document before it is
    constructed; a merge key (``<<``) may still be overridden, as YAML intends.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique_keys(node, [], set())
        return super().construct_document(node)

    def _check_unique_keys(self, node: yaml.Node, path: list[str], seen: set[int]) -> None:
        if id(node) in seen:  # an alias of a node already walked (or of its own parent)
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique_keys(item, [*path, str(i)], seen)
        elif isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                line = key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise DuplicateKeyError(".".join([*path, str(key)]), str(key), lines[key], line)
                    lines[key] = line
                except TypeError:  # an unhashable key: the constructor refuses it with its own message
                    continue
                self._check_unique_keys(value_node, [*path, str(key)], seen)
