"""Sources for ingest: an ImageFolder tree or a CSV/JSONL manifest.

:func:`scan` turns a path into a :class:`Source`: the image files to ingest,
in a deterministic order, with their labels, plus the files it skipped. An
**ImageFolder** has one subfolder per class (searched recursively; class names
in Unicode NFC, sorted by code point, numbered ``0..n-1``). A **manifest**
(``.csv``, ``.jsonl``, ``.ndjson``) has a ``path`` column (relative to the
manifest), a ``label`` column (a class name), an optional ``target`` column (a
mask or multilabel blob) and any other columns, kept as ``tags``. Non-image
extensions and hidden files are skipped and counted; nothing here opens an
image (``_validate.py`` decides whether a file is one).
"""

from __future__ import annotations

import csv
import json
import os
import posixpath
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._errors import ConfigError
from ._model import normalize_relpath

__all__ = [
    "IMAGE_EXTENSIONS", "SourceFile", "Source", "scan", "scan_imagefolder", "scan_manifest", "is_image_name",
    "require_images",
]

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".gif", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)
MANIFEST_EXTENSIONS = (".csv", ".jsonl", ".ndjson")
_RESERVED_COLUMNS = ("path", "label", "target")


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file to ingest."""

    path: str  # where to read it (absolute, or as given)
    relpath: str  # normalized path relative to the dataset root: the id key
    label: int
    target: str | None = None  # where to read the raw target blob, if any
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Source:
    """What :func:`scan` found. ``files`` are sorted by ``relpath``."""

    root: str
    label_names: tuple[str, ...]
    files: tuple[SourceFile, ...]
    skipped: tuple[str, ...]  # relpaths of non-image and hidden files
    #: ``(relpath, reason)`` of image files that cannot get an id (a name that is not UTF-8)
    unusable: tuple[tuple[str, str], ...] = ()
    manifest: str | None = None  # the manifest file, when scanned from one


def is_image_name(name: str) -> bool:
    """True for a visible file name with an image extension (any case)."""
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(".") and os.path.splitext(base)[1].lower() in IMAGE_EXTENSIONS


def scan(src: str | os.PathLike[str]) -> Source:
    """Scan an ImageFolder directory or a manifest file (see module docs)."""
    path = os.fspath(src)
    if os.path.isdir(path):
        return scan_imagefolder(path)
    if os.path.isfile(path):
        if path.lower().endswith(MANIFEST_EXTENSIONS):
            return scan_manifest(path)
        raise ConfigError(f"source {path!r} is a file but not a manifest (.csv, .jsonl or .ndjson)")
    raise ConfigError(f"source {path!r} does not exist")


def _text(name: str, where: str) -> str:
    """NFC ``name``; ConfigError if the OS handed us bytes that are not UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where}: file name {name.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8") from None
    return unicodedata.normalize("NFC", name)


def _walk(top: str):
    """Yield ``(relpath_from_top, is_dir=False)`` for every file under ``top``.

    Hidden directories are not entered; directory symlinks are not followed
    (no loops); file symlinks are kept.
    """
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(top, rel) if rel else top))
        except OSError as exc:
            raise ConfigError(f"cannot list {os.path.join(top, rel)!r}: {exc.strerror}") from exc
        for entry in entries:
            child = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                if not entry.name.startswith("."):
                    stack.append(child)
            else:
                yield child


def scan_imagefolder(root: str | os.PathLike[str]) -> Source:
    """Scan ``root/<class>/**/<file>``. Files directly under ``root`` are skipped."""
    root = os.path.abspath(os.fspath(root))
    try:
        top = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise ConfigError(f"cannot list source {root!r}: {exc.strerror}") from exc
    class_dirs = {}
    skipped: list[str] = []
    for entry in top:
        if entry.is_dir() and not entry.name.startswith("."):
            class_dirs[_text(entry.name, root)] = entry.name
        elif not entry.is_dir():
            skipped.append(unicodedata.normalize("NFC", os.fsencode(entry.name).decode("utf-8", "replace")))
    label_names = tuple(sorted(class_dirs))
    if not label_names:
        found = f"found {_kinds(skipped)} and no class folders" if skipped else "the folder is empty"
        raise ConfigError(f"no images in {root!r}: {found}; an ImageFolder tree is root/<class>/<image>")
    files: list[SourceFile] = []
    unusable: list[tuple[str, str]] = []
    for label, name in enumerate(label_names):
        disk_name = class_dirs[name]
        for rel in _walk(os.path.join(root, disk_name)):
            try:
                relpath = normalize_relpath(f"{name}/{_text(rel, root)}")
            except ConfigError:
                shown = f"{name}/{os.fsencode(rel).decode('utf-8', 'replace')}"
                if is_image_name(shown):
                    unusable.append((shown, "file name is not valid UTF-8"))
                else:
                    skipped.append(shown)
                continue
            if is_image_name(relpath):
                files.append(SourceFile(os.path.join(root, disk_name, rel), relpath, label))
            else:
                skipped.append(relpath)
    files.sort(key=lambda f: f.relpath)
    return Source(root, label_names, tuple(files), tuple(sorted(skipped)), tuple(sorted(unusable)))


def _rows(manifest: str):
    """Yield ``(line_number, dict)`` from a CSV or JSONL manifest."""
    try:
        fh = open(manifest, encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise ConfigError(f"cannot open manifest {manifest!r}: {exc.strerror}") from exc
    with fh:
        try:
            if manifest.lower().endswith(".csv"):
                reader = csv.DictReader(fh)
                for row in reader:
                    if None in row:
                        raise ConfigError(f"{manifest}:{reader.line_num}: more cells than header columns")
                    yield reader.line_num, {k: v for k, v in row.items() if v not in (None, "")}
                return
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{manifest}:{n}: not valid JSON ({exc.msg})") from exc
                if not isinstance(row, dict):
                    raise ConfigError(f"{manifest}:{n}: each line must be a JSON object")
                yield n, {k: _tag_value(v) for k, v in row.items() if v is not None}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"manifest {manifest!r} is not UTF-8 text") from exc
        except csv.Error as exc:
            raise ConfigError(f"manifest {manifest!r}: {exc}") from exc


def _tag_value(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _resolve(base: str, given: str) -> tuple[str, str]:
    """``(path to read, relpath)`` for a path from a manifest."""
    p = given.replace("\\", "/")
    if posixpath.isabs(p) or os.path.isabs(given):
        full = os.path.normpath(given)
        rel = os.path.relpath(full, base)
        relpath = rel if not rel.startswith("..") else full
    else:
        full = os.path.normpath(os.path.join(base, given))
        relpath = posixpath.normpath(p)
    return full, normalize_relpath(relpath)


def scan_manifest(manifest: str | os.PathLike[str]) -> Source:
    """Scan a CSV or JSONL manifest (see module docs)."""
    manifest = os.path.abspath(os.fspath(manifest))
    base = os.path.dirname(manifest)
    rows: list[tuple[str, str, str, str | None, dict[str, str]]] = []
    skipped: list[str] = []
    seen: dict[str, int] = {}
    for n, row in _rows(manifest):
        where = f"{manifest}:{n}"
        if "path" not in row:
            raise ConfigError(f"{where}: row has no 'path' value")
        if "label" not in row:
            raise ConfigError(f"{where}: row has no 'label' value")
        full, relpath = _resolve(base, row["path"])
        if not is_image_name(relpath):
            skipped.append(relpath)
            continue
        if relpath in seen:
            raise ConfigError(f"{where}: path {relpath!r} is listed twice (first on line {seen[relpath]})")
        seen[relpath] = n
        target = _resolve(base, row["target"])[0] if "target" in row else None
        tags = {k: v for k, v in row.items() if k not in _RESERVED_COLUMNS}
        rows.append((full, relpath, unicodedata.normalize("NFC", row["label"]), target, tags))
    del seen
    label_names = tuple(sorted({r[2] for r in rows}))
    index = {name: i for i, name in enumerate(label_names)}
    files = [SourceFile(full, rel, index[label], target, tags) for full, rel, label, target, tags in rows]
    files.sort(key=lambda f: f.relpath)
    return Source(base, label_names, tuple(files), tuple(sorted(skipped)), manifest=manifest)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _kinds(paths, what: str = "file") -> str:
    """``"3 files (.csv, .txt)"``: how many, and their extensions."""
    paths = list(paths)
    exts = sorted({os.path.splitext(p.rsplit("/", 1)[-1])[1].lower() or "no extension" for p in paths})
    return f"{_count(len(paths), what)} ({', '.join(exts[:8])}{', ...' if len(exts) > 8 else ''})"


def require_images(src: Source) -> None:
    """ConfigError unless ``src`` has an image to ingest, saying what it holds instead.

    An ingest of nothing is almost always a wrong path; refusing it keeps an
    empty dataset out of the store.
    """
    if src.files:
        return
    if src.manifest is not None:
        found = f"it lists {_kinds(src.skipped, 'path')}, none an image" if src.skipped else "it has no rows"
        raise ConfigError(f"no images in manifest {src.manifest!r}: {found}")
    n = len(src.label_names)
    classes = f"class folder{'s' if n != 1 else ''} {', '.join(src.label_names[:10])}{', ...' if n > 10 else ''}"
    if src.unusable:
        raise ConfigError(
            f"no images in {src.root!r} can be ingested: {_count(len(src.unusable), 'image file')} under {classes} "
            f"cannot get an id, their names are not valid UTF-8 (first: {src.unusable[0][0]!r})"
        )
    if src.skipped:
        found = f"{'holds' if n == 1 else 'hold'} no images; found {_kinds(src.skipped, 'other file')}"
    else:
        found = "is empty" if n == 1 else "are empty"
    raise ConfigError(f"no images in {src.root!r}: {classes} {found}")
