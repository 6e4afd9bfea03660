"""Where a job's files may be: the checks on the job spec's folders and URLs (checkpoints, token data, storage).

A folder is a local absolute path or a Cloud Storage URL ``gs://BUCKET/FOLDER``. A URL's
bucket must have the form Cloud Storage allows; its folder part has no empty, ``.`` or
``..`` segments (object stores take them literally, so ``gs://b/x/../y`` would be another
folder than it reads as) and no glob characters (fsspec would expand them). A local folder is
not in the kernel's own trees (/proc, /sys, /dev but /dev/shm): they hold processes, settings
and devices, not files (a checkpoint folder under /proc/self was accepted, and failed at the
first save). Each check raises ValueError with the message a user sees after the field's name.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

# https://cloud.google.com/storage/docs/buckets#naming
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]*[a-z0-9]")
BUCKET_RULE = ("3 to 63 lowercase letters, digits, dashes, underscores and dots (up to 222 with dots, at most "
               "63 between two), starting and ending with a letter or digit")
# "gs:", "s3:", "file:" ...: what a URL starts with. A scheme of one letter is left out (a Windows drive).
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
_UNSAFE_IN_URL = set("*?[]#\\") | {chr(c) for c in range(33)} | {"\x7f"}
_UNSAFE_SHOWN = "* ? [ ] # \\"


def looks_like_url(value: str) -> bool:
    """Whether `value` starts like a URL (``scheme:``), so that it must never be taken as a relative path."""
    return bool(_SCHEME_RE.match(value))


def bucket_problem(name: str) -> str | None:
    """Why `name` cannot be a Cloud Storage bucket's name, or None."""
    if not _BUCKET_RE.fullmatch(name) or not 3 <= len(name) <= 222:
        return f"{name!r} is not a bucket name: use {BUCKET_RULE}"
    parts = name.split(".")
    if len(name) > 63 and len(parts) == 1 or any(not p or len(p) > 63 for p in parts):
        return f"{name!r} is not a bucket name: use {BUCKET_RULE}"
    if name.startswith("goog") or "google" in name:
        return f"{name!r} is not a bucket name: it may not start with 'goog' or contain 'google'"
    try:
        ipaddress.ip_address(name)
        return f"{name!r} is not a bucket name: it may not be an IP address"
    except ValueError:
        return None


def check_bucket(name: str) -> str:
    if name.startswith("gs://"):
        raise ValueError(f"must be a bucket's name without gs://, got {name!r}")
    problem = bucket_problem(name)
    if problem:
        raise ValueError(problem)
    return name


def check_gs_url(url: str, *, folder_required: bool) -> str:
    """`url` (``gs://BUCKET/FOLDER``) without a trailing slash; ValueError naming what is wrong."""
    rest = url[len("gs://"):]
    bucket, _, folder = rest.partition("/")
    problem = bucket_problem(bucket)
    if problem:
        raise ValueError(f"{url!r}: {problem}")
    folder = folder.removesuffix("/")
    if not folder:
        if folder_required:
            raise ValueError(f"must name a folder inside the bucket, e.g. gs://{bucket}/checkpoints/my-job, "
                             f"got {url!r}")
        return f"gs://{bucket}"
    bad = sorted(set(folder) & _UNSAFE_IN_URL)
    if bad:
        raise ValueError(f"{url!r}: a Cloud Storage folder here may not contain spaces, control characters or "
                         f"{_UNSAFE_SHOWN} (got {''.join(bad)!r})")
    if any(seg in ("", ".", "..") for seg in folder.split("/")):
        raise ValueError(f"{url!r}: no empty, '.' or '..' parts between slashes (a bucket takes them literally)")
    return f"gs://{bucket}/{folder}"


def check_checkpoint_directory(value: str) -> str:
    """A local absolute path, or ``gs://BUCKET/FOLDER`` (what orbax writes through
    tensorstore and this tool configures)."""
    _no_control(value)
    if value.startswith("gs://"):
        return check_gs_url(value, folder_required=True)
    if looks_like_url(value):
        raise ValueError(f"must be an absolute path or a Cloud Storage URL gs://BUCKET/FOLDER, got {value!r}")
    if not Path(value).is_absolute():
        raise ValueError(f"must be an absolute path, got {value!r} (in a job file, a relative path is taken "
                         "from the file's folder)")
    if (problem := kernel_tree_problem(value)) is not None:
        raise ValueError(f"{value!r} {problem}")
    return value


_KERNEL_TREES = {"/proc": "the kernel's view of processes", "/sys": "the kernel's settings and devices",
                 "/dev": "device files"}
_FILES_UNDER_DEV = "/dev/shm"  # shared memory: a file system for files like any other


def kernel_tree_problem(path: str | os.PathLike) -> str | None:
    """Why a local `path` is no place for a user's files ("is in /proc, ..."; in /proc, /sys or /dev, /dev/shm
    apart), or None. The path is looked at as given and with its links resolved (``/proc/self`` is a link)."""
    for p in {os.path.abspath(path), os.path.realpath(path)}:
        if p == _FILES_UNDER_DEV or p.startswith(_FILES_UNDER_DEV + "/"):
            continue
        for root, what in _KERNEL_TREES.items():
            if p == root or p.startswith(root + "/"):
                return f"is in {root}, {what}, not a place for files; use a folder on a disk"
    return None


def check_data_path(value: str) -> str:
    """A local absolute path, ``gs://BUCKET[/FOLDER]``, or another fsspec URL (``file://``, ``memory://``)."""
    if not value.strip() or any(c in value for c in "\0\n\r"):
        raise ValueError(f"must be a non-empty path or URL without NUL or line breaks, got {value!r}")
    if value.startswith("gs://"):
        return check_gs_url(value, folder_required=False)
    if looks_like_url(value) and "://" not in value:
        raise ValueError(f"looks like a URL but has no '://' (e.g. gs://BUCKET/FOLDER), got {value!r} (a relative "
                         "path that starts with a word and a colon: write ./ in front)")
    if "://" not in value and not Path(value).is_absolute():
        raise ValueError(f"must be an absolute path or a URL, got {value!r} (in a job file, a relative path is "
                         "taken from the file's folder)")
    return value


def check_endpoint(value: str) -> str:
    """An HTTP(S) endpoint ``http://HOST[:PORT]`` without a path (an emulator's), without a trailing slash."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL like http://127.0.0.1:8471, got {value!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"must be a scheme, host and port only (no path, query or credentials), got {value!r}")
    try:
        _ = parts.port  # urllib parses the port only when asked
    except ValueError:
        raise ValueError(f"has a port that is not a number from 0 to 65535, got {value!r}") from None
    return value.rstrip("/")


def _no_control(value: str) -> None:
    if not value.strip():
        raise ValueError("must not be empty; leave it out for the default")
    if any(c in value for c in "\0\n\r"):
        raise ValueError(f"must not contain NUL or line breaks, got {value!r}")
