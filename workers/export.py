"""Trained weights out of a job's checkpoints, as safetensors, and back into the same pytree.

An export is a folder::

    model.safetensors   one tensor per leaf, named by its key path ("params" left out):
                        "embed", "layers/0/wq", ...; dtypes as trained (bfloat16 stays bfloat16)
    config.json         {"format": "orchestrator-weights", "version": 1, "job": ..., "step": ...,
                         "subtree": "params", "model": {...} or null, "meta": {...},
                         "tree": the pytree's structure with each leaf's tensor name}

safetensors because every framework reads it (PyTorch, JAX/Flax, NumPy, the Hugging Face
stack) without running code from the file, as pickles would. The names alone cannot tell a
list from a dict keyed "0", "1", so `tree` keeps the structure: `load` rebuilds the very
same nested dicts and lists (a tuple comes back as a list).

The checkpoint read is the layout the workers write: an orbax CheckpointManager folder
whose step folders hold the items `state` (StandardSave of the pytree, parameters under
`state["params"]`) and `meta` (JsonSave, with at least `step`); a folder holding one
unnamed item (`default`, as older built-in trainers wrote) is read too. It is restored
on this process's first CPU device, whatever mesh wrote it: the target is built from
orbax's own metadata of the item, so no model code is needed.

Either folder, the checkpoints and the export, may be in a bucket (``gs://bucket/folder``,
through `workers.storage`; its endpoint set with `workers.storage.configure`).

Example::

    exported = export_checkpoint("/ckpt/tiny-lm", "weights/", job={"id": "tiny-lm-3f2a1c"})
    params, config = load("weights/")          # or export to and load from "gs://bucket/weights"

The structure saved is what orbax keeps of the pytree: nested dicts and lists with string
keys. A program's own pytree types (an `nnx.State`, whose leaves' paths end in `value`, a
dataclass, any registered pytree) come back as themselves with `like=`: a pytree of that
structure (its leaves anything: the initial parameters, `jax.ShapeDtypeStruct`s) whose
leaves are matched to the tensors by key path::

    model = MyModel(nnx.Rngs(0))
    params, config = load("weights/", like=nnx.state(model, nnx.Param))
    nnx.update(model, params)
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers import storage

FORMAT = "orchestrator-weights"
VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an export that cannot be read; `where` names the folder or file."""

    def __init__(self, where: str, problem: str):
        self.where, self.problem = str(where), problem
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):
        return type(self), (self.where, self.problem)


@dataclass(frozen=True)
class Exported:
    out: Path | str  # a str for a bucket's folder (gs://...)
    step: int
    tensors: int
    parameters: int  # scalars over all tensors
    bytes: int


# -- the pytree as named tensors ----------------------------------------------------------


def flatten(tree: Any) -> tuple[dict[str, np.ndarray], Any]:
    """Named tensors and the structure: dicts stay dicts, lists and tuples become lists, a leaf its name."""
    tensors: dict[str, np.ndarray] = {}

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            for k in node:
                if not isinstance(k, str) or not k or "/" in k:
                    raise ExportError("/".join(path) or "<root>", f"key {k!r}: only non-empty strings without '/' "
                                                                   "can name a tensor")
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v, (*path, str(i))) for i, v in enumerate(node)]
        if node is None:
            return None
        name = "/".join(path) or "value"
        tensors[name] = np.asarray(node, order="C")  # not ascontiguousarray: it makes a scalar 1-d
        return name

    return tensors, walk(tree, ())


def unflatten(structure: Any, tensors: dict[str, np.ndarray]) -> Any:
    if isinstance(structure, dict):
        return {k: unflatten(v, tensors) for k, v in structure.items()}
    if isinstance(structure, list):
        return [unflatten(v, tensors) for v in structure]
    if structure is None:
        return None
    return tensors[structure]


# -- writing and reading an export ---------------------------------------------------------


def save(tree: Any, out: str | Path, *, config: dict, force: bool = False) -> Exported:
    """Write `tree` and `config` (plus the structure) to `out`, atomically: a temporary folder renamed at the end.

    `out` may be a bucket's folder (``gs://bucket/weights``), which has no rename: the files
    are written here first, then uploaded, config.json last, so that `load` never reads a
    part (a replaced export, with `force`, is deleted before the new one is uploaded).
    """
    from safetensors.numpy import save_file

    if storage.is_url(out):
        return _save_to_bucket(tree, str(out), config=config, force=force)
    out = Path(out)
    if out.is_symlink():  # dangling or not: the rename at the end would fail, or replace the link, not its target
        raise ExportError(str(out), "is a symbolic link; give the path of a folder (its target is left alone)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(str(out), "exists and is not empty (--force replaces it)")
    tensors, structure = flatten(tree)
    if not tensors:
        raise ExportError(str(out), "the pytree has no arrays to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "np"})
        full = {"format": FORMAT, "version": VERSION, **config, "tree": structure}
        (tmp / CONFIG).write_text(json.dumps(full, indent=2, default=_json_default) + "\n")
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / "replaced")
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out=out, step=int(config.get("step", -1)), tensors=len(tensors),
                    parameters=sum(int(t.size) for t in tensors.values()),
                    bytes=(out / WEIGHTS).stat().st_size)


def _save_to_bucket(tree: Any, out: str, *, config: dict, force: bool) -> Exported:
    from safetensors.numpy import save_file

    out = out.rstrip("/")
    if storage.exists(out) and not force:
        raise ExportError(out, "exists and is not empty (--force replaces it)")
    tensors, structure = flatten(tree)
    if not tensors:
        raise ExportError(out, "the pytree has no arrays to write")
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        save_file(tensors, str(Path(tmp) / WEIGHTS), metadata={"format": "np"})
        full = {"format": FORMAT, "version": VERSION, **config, "tree": structure}
        (Path(tmp) / CONFIG).write_text(json.dumps(full, indent=2, default=_json_default) + "\n")
        size = (Path(tmp) / WEIGHTS).stat().st_size
        storage.remove_tree(out)
        storage.upload_folder(tmp, out, last=(CONFIG,))  # config.json last: an export is whole once it is there
    return Exported(out=out, step=int(config.get("step", -1)), tensors=len(tensors),
                    parameters=sum(int(t.size) for t in tensors.values()), bytes=size)


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")


def load(folder: str | Path, *, like: Any = None) -> tuple[Any, dict]:
    """The exported pytree and the config.

    Without `like`: NumPy arrays in nested dicts and lists, as orbax kept the trained tree.
    With `like`: the tree of `like`'s own structure and types (an `nnx.State`, a flax
    dict, a dataclass, any registered pytree), each leaf the tensor its key path names
    (a JAX array where `like`'s leaf is one, else NumPy; the dtype as exported). A path
    is matched whole, else without the `value` parts that flax's variables add (so a
    pure dict and an `nnx.State` load each other's exports). `ExportError` names the
    leaves that `like` has and the export does not, those it has and `like` does not,
    and any shape that differs.
    """
    import safetensors.numpy

    config_file, weights_file = storage.join(folder, CONFIG), storage.join(folder, WEIGHTS)
    for name in (config_file, weights_file):
        if not (storage.exists(name) if storage.is_url(name) else Path(name).is_file()):
            raise ExportError(name, "missing: not an export folder (make one with `orchestrator export`)")
    try:
        config = json.loads(storage.read_text(config_file))
    except json.JSONDecodeError as e:
        raise ExportError(config_file, f"not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT or "tree" not in config:
        raise ExportError(config_file, f"not an export's config (expected \"format\": \"{FORMAT}\")")
    if storage.is_url(weights_file):  # a bucket: a local copy for load_file (bfloat16 needs its reader)
        with tempfile.TemporaryDirectory(prefix="export-") as tmp:
            local = Path(tmp) / WEIGHTS
            local.write_bytes(storage.read_bytes(weights_file))
            tensors = safetensors.numpy.load_file(str(local))
    else:
        tensors = safetensors.numpy.load_file(weights_file)
    structure = config.pop("tree")
    if like is not None:
        return like_tree(like, tensors, where=str(folder)), config
    try:
        return unflatten(structure, tensors), config
    except KeyError as e:
        raise ExportError(weights_file, f"has no tensor {e.args[0]!r} that config.json names") from None


def _path_name(path: tuple) -> tuple[str, ...]:
    """A JAX key path as the parts of a tensor name: dict keys, sequence indices and attribute names, as text."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return tuple(parts)


def _without_values(parts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for p in parts if p != "value")


def like_tree(like: Any, tensors: dict[str, np.ndarray], *, where: str = "<export>") -> Any:
    """`like`'s structure with each leaf replaced by the tensor of the same path (see `load`)."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = {tuple(n.split("/")): n for n in tensors}
    wanted = [_path_name(path) for path, _ in leaves]
    if not all(w in names for w in wanted):  # not whole: try without flax's "value" parts, if that is unambiguous
        loose: dict[tuple[str, ...], list[str]] = {}
        for parts, n in names.items():
            loose.setdefault(_without_values(parts), []).append(n)
        if all(len(v) == 1 for v in loose.values()) and len({_without_values(w) for w in wanted}) == len(wanted):
            names = {w: loose[_without_values(w)][0] for w in wanted if _without_values(w) in loose}
    missing = ["/".join(w) for w in wanted if w not in names]
    unused = sorted(set(tensors) - {names[w] for w in wanted if w in names})
    problems = []
    if missing:
        problems.append(f"has no tensor for {len(missing)} leaf(s) of `like`: {_few(missing)}")
    if unused:
        problems.append(f"has {len(unused)} tensor(s) that `like` has no leaf for: {_few(unused)}")
    out = []
    for w, (_, leaf) in zip(wanted, leaves, strict=True):
        if w not in names:
            continue
        t = tensors[names[w]]
        shape = getattr(leaf, "shape", None)
        if shape is not None and tuple(shape) != t.shape:
            problems.append(f"{names[w]}: shape {t.shape} in the export, {tuple(shape)} in `like`")
        out.append(jax.numpy.asarray(t) if isinstance(leaf, jax.Array) else t)
    if problems:
        raise ExportError(where, "does not fit `like`: " + "; ".join(problems))
    return jax.tree_util.tree_unflatten(treedef, out)


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# -- from a checkpoint -------------------------------------------------------------------


def checkpoint_steps(directory: str | Path) -> list[int]:
    """The committed steps in an orbax checkpoint folder, oldest first (unfinished saves are not steps)."""
    mngr = _manager(directory)
    try:
        return sorted(int(s) for s in mngr.all_steps())
    finally:
        mngr.close()


def _manager(directory: str | Path):
    import orbax.checkpoint as ocp
    from etils import epath

    if storage.is_url(str(directory)):
        storage.configure_from_environment()  # an emulator that only STORAGE_EMULATOR_HOST names

    if not epath.Path(directory).is_dir():
        raise ExportError(str(directory), "no such checkpoint folder")
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # read_only makes orbax warn three times that it is read-only
    try:
        return ocp.CheckpointManager(
            directory, item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                                      "default": ocp.StandardCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(read_only=True))
    finally:
        absl.setLevel(level)


def restore(directory: str | Path, step: int) -> tuple[Any, dict]:
    """The state pytree saved at `step` (on one CPU device) and its `meta` dict ({} if the layout has none)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    root = epath.Path(directory) / str(step)
    item = "state" if (root / "state").is_dir() else "default" if (root / "default").is_dir() else None
    if item is None:
        raise ExportError(str(root), "holds neither a 'state' nor a 'default' item")
    device = jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    mngr = _manager(directory)
    try:
        metadata = mngr.item_metadata(step)[item]
        tree = getattr(metadata, "tree", metadata)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), tree)
        args = {item: ocp.args.StandardRestore(target)}
        if (root / "meta").is_dir():
            args["meta"] = ocp.args.JsonRestore()
        restored = mngr.restore(step, args=ocp.args.Composite(**args))
        state, meta = restored[item], (restored["meta"] if "meta" in args else None) or {}
    finally:
        mngr.close()
    return jax.tree.map(np.asarray, state), dict(meta)


def _subtree(state: Any, path: str, *, where: str) -> Any:
    """The part of `state` at `path` ("a/b/0"; "" the whole); ExportError naming what is there instead."""
    node: Any = state
    done: list[str] = []
    for part in [p for p in path.split("/") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            at = "/".join(done) or "the state"
            has = (_few(sorted(map(str, node))) if isinstance(node, dict) else
                   f"indices 0 to {len(node) - 1}" if isinstance(node, (list, tuple)) else "a single array")
            raise ExportError(where, f"--subtree {path}: {at} has no {part!r}; it has {has}")
        done.append(part)
    return node


def export_checkpoint(directory: str | Path, out: str | Path, *, step: int | None = None,
                      config: dict | None = None, force: bool = False, subtree: str | None = None) -> Exported:
    """Export the checkpoint at `step` (None: the newest committed one) of `directory` to `out`.

    `subtree`: the part of the state to write, a key path (``params``, ``opt_state/mu``, ``ema/0``: dict
    keys and list indices joined by ``/``), or ``""`` (or ``/``) for the whole state; None writes the
    `params` subtree when the state has one, else the whole state. `config` (the job, the model) is
    added to config.json with the step, the subtree and the checkpoint's meta.
    """
    steps = checkpoint_steps(directory)
    if not steps:
        raise ExportError(str(directory), "holds no committed checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(str(directory), f"has no committed checkpoint of step {step}; it has "
                                          f"{', '.join(map(str, steps))}")
    if subtree is not None:
        subtree = subtree.strip("/")
    state, meta = restore(directory, step)
    if subtree is None:
        subtree = "params" if isinstance(state, dict) and "params" in state else ""
    tree = _subtree(state, subtree, where=f"{directory} (step {step})")
    return save(tree, out, force=force, config={**(config or {}), "step": step, "subtree": subtree, "meta": meta,
                                                "checkpoint": str(directory)})
