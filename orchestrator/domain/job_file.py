"""Reading a job file: what it is, its size, its YAML, its depth, and keys given twice.

`read_job_file` is the first half of `JobSpec.from_yaml`: it turns a path into the plain
data the spec validates, or a `SpecError` naming the file. Only a regular file is opened,
and without blocking: a FIFO with no writer, a socket or a device would hang or feed the
parser without end, so anything else is refused from its `stat` (and again from the open
file's, so a file swapped in between is caught). A job file is a page of settings, so one
over 1 MiB is refused before it is parsed (a 50 MB file once took 13 s to be accepted);
so is one nested more than `MAX_DEPTH` levels deep (20,000 nested lists took the YAML
composer, which recurses, into a RecursionError), checked as each node is composed, and an
integer written with more than `MAX_INT_CHARS` characters (Python refuses to convert one
of over 4,300 digits; no setting needs more than 20). Plain YAML keeps the last of two
equal keys, so a key given twice is refused with both lines.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import SpecError

MAX_JOB_FILE_BYTES = 2**20  # 1 MiB
MAX_DEPTH = 64  # collections within collections; a job file's deepest setting is 4 levels down
MAX_INT_CHARS = 100  # an integer's literal, sign, base prefix and underscores included

_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def read_job_file(path: Path) -> Any:
    """The YAML document in `path`, or SpecError: not found, not a regular file, unreadable, too big, too deep,
    an integer too long, a duplicate key, bad YAML."""
    source = str(path)
    raw = _read_regular_file(path, source)
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise SpecError(source, [("", f"cannot read the file: not UTF-8 text ({e.reason} at byte {e.start})")]) \
            from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except _NodeError as e:
        raise SpecError(source, [(e.path, str(e))]) from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(source, [("", f"invalid YAML{where}: {problem}")]) from None
    return data


def _read_regular_file(path: Path, source: str) -> bytes:
    """At most `MAX_JOB_FILE_BYTES` bytes of `path`, a regular file; opened without blocking, never a FIFO or device."""
    try:
        kind = _not_regular(os.stat(path))
        if kind:
            raise SpecError(source, [("", f"is {kind}, not a regular file; give the job's YAML file")])
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise SpecError(source, [("", _open_problem(e))]) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        kind = _not_regular(st)
        if kind:  # replaced between the stat and the open
            raise SpecError(source, [("", f"is {kind}, not a regular file; give the job's YAML file")])
        if st.st_size > MAX_JOB_FILE_BYTES:
            raise SpecError(source, [("", _too_big(st.st_size))])
        try:
            raw = f.read(MAX_JOB_FILE_BYTES + 1)  # at most one byte over the limit, whatever the file's size now
        except OSError as e:
            raise SpecError(source, [("", f"cannot read the file: {e.strerror or e}")]) from None
    if len(raw) > MAX_JOB_FILE_BYTES:  # it grew since the fstat
        raise SpecError(source, [("", _too_big(len(raw)))])
    return raw


def _not_regular(st: os.stat_result) -> str | None:
    if stat.S_ISREG(st.st_mode):
        return None
    return next((kind for test, kind in _NOT_REGULAR if test(st.st_mode)), "not a file")


def _open_problem(e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return "file not found"
    if e.errno == errno.ELOOP:
        return "is a loop of symbolic links (or a chain of more than the system follows)"
    if e.errno == errno.ENAMETOOLONG:
        return "cannot read the file: its name is too long for the file system"
    if e.errno == errno.ENXIO:  # a socket, or a device with nothing behind it
        return "is not a regular file; give the job's YAML file"
    return f"cannot read the file: {e.strerror or e}"


def _too_big(size: int) -> str:
    return f"job file is {size:,} bytes; the limit is 1 MiB ({MAX_JOB_FILE_BYTES:,} bytes)"


class _NodeError(ValueError):
    """A problem of one node of the document; `path` is its field path (empty at the top)."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(message)


class TooDeepError(_NodeError):
    """Collections nested more than `MAX_DEPTH` levels: refused while composing, before the parser recurses further."""

    def __init__(self, mark: yaml.Mark):
        super().__init__("", f"nested more than {MAX_DEPTH} levels deep at line {mark.line + 1}, column "
                             f"{mark.column + 1}; a job file's settings are at most a few levels deep")


class IntegerTooLongError(_NodeError):
    """An integer literal of more than `MAX_INT_CHARS` characters; refused before Python converts it."""

    def __init__(self, path: str, chars: int, line: int):
        super().__init__(path, f"an integer of {chars:,} characters at line {line}; the limit is {MAX_INT_CHARS} "
                               "(no setting needs more than 20)")


class DuplicateKeyError(_NodeError):
    """A key given twice in one YAML mapping; `path` is the field path of the mapping's key."""

    def __init__(self, path: str, key: str, first_line: int, second_line: int):
        super().__init__(path, f"duplicate key {key!r} at lines {first_line} and {second_line} (YAML would "
                               "silently keep the last); give it once")


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in any mapping, at any depth, collections nested
    more than `MAX_DEPTH` deep, and integers longer than `MAX_INT_CHARS`.

    Plain YAML keeps the last of two equal keys, so a job file that sets `steps` twice
    runs with whichever came later. The keys and integers are checked on the composed
    document before it is constructed; a merge key (``<<``) may still be overridden, as
    YAML intends. The depth is counted as the composer descends (it recurses once per level).
    """

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self._depth >= MAX_DEPTH and (self.check_event(yaml.SequenceStartEvent)
                                         or self.check_event(yaml.MappingStartEvent)):
            raise TooDeepError(self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_nodes(node, [], set())
        return super().construct_document(node)

    def _check_nodes(self, node: yaml.Node, path: list[str], seen: set[int]) -> None:
        if id(node) in seen:  # an alias of a node already walked (or of its own parent)
            return
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            self._check_integer(node, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_nodes(item, [*path, str(i)], seen)
        elif isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                if isinstance(key_node, yaml.ScalarNode):
                    self._check_integer(key_node, path)
                    key = self.construct_object(key_node)
                else:
                    key = id(key_node)
                line = key_node.start_mark.line + 1
                try:
                    if key in lines:
                        raise DuplicateKeyError(".".join([*path, str(key)]), str(key), lines[key], line)
                    lines[key] = line
                except TypeError:  # an unhashable key: the constructor refuses it with its own message
                    continue
                self._check_nodes(value_node, [*path, str(key)], seen)

    @staticmethod
    def _check_integer(node: yaml.ScalarNode, path: list[str]) -> None:
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_INT_CHARS:
            raise IntegerTooLongError(".".join(path), len(node.value), node.start_mark.line + 1)
