"""Metadata filters: ``width >= 256 and label_name in ("cat", "dog")``.

A filter is tokenized and parsed by recursive descent into a small AST (never
evaluated as code), then compiled into a predicate over a sample's
:class:`~dataferry.schema.SampleMeta`; the same predicate runs for every
backend, so a filter selects the same ids everywhere. Fields: ``id``,
``label``, ``width``, ``height``, ``size``, ``label_name``, ``format``,
``path``, ``tags.KEY``; tests: comparisons, ``in``, ``between``, ``glob``
(linear in the path: no regular expressions), ``exists``, with ``and``,
``or``, ``not``. A bad filter raises :class:`FilterError` naming the position.
The grammar and its rules in full: README.md, The filter language.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ._errors import ConfigError, FilterError
from ._model import SampleMeta

__all__ = ["FilterError", "parse_filter", "compile_filter", "Filter", "MAX_FILTER_CHARS"]

#: limits that keep a filter from a client cheap to parse and to run
MAX_FILTER_CHARS = 8192
_MAX_DEPTH = 64
_MAX_IN_VALUES = 10_000
_MAX_NUMBER_CHARS = 64

_NUMBER_FIELDS = {"id": "id", "label": "label", "width": "width", "height": "height", "size": "size", "bytes": "size"}
_TEXT_FIELDS = {"label_name", "format", "path"}
_KEYWORDS = {"and", "or", "not", "in", "between", "glob", "exists"}
_OPS = ("==", "!=", "<>", "<=", ">=", "=", "<", ">")
_CANON_OP = {"==": "=", "<>": "!="}
_FLIP = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


# --- tokens ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # "name", "kw", "num", "str", "op", "end"
    value: object
    pos: int  # 0-based offset of the token's first character
    raw: str


_NUM_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c in "()," or (c == "." and not text[i + 1 : i + 2].isdigit()):
            out.append(_Tok("op", c, i, c))
            i += 1
            continue
        op = next((o for o in _OPS if text.startswith(o, i)), None)
        if op is not None:
            out.append(_Tok("op", _CANON_OP.get(op, op), i, op))
            i += len(op)
            continue
        if c in "\"'":
            value, end = _string(text, i)
            out.append(_Tok("str", value, i, text[i:end]))
            i = end
            continue
        m = _NUM_RE.match(text, i)
        if m and (c.isdigit() or c in "+-."):
            raw = m.group()
            end = m.end()
            if end < n and (text[end].isalnum() or text[end] == "_"):
                raise FilterError(text, i + 1, f"malformed number {text[i:end + 1]!r}")
            if len(raw) > _MAX_NUMBER_CHARS:
                raise FilterError(text, i + 1, f"number of {len(raw)} characters; the limit is {_MAX_NUMBER_CHARS}")
            value: object = int(raw) if re.fullmatch(r"[+-]?\d+", raw) else float(raw)
            if isinstance(value, float) and not math.isfinite(value):
                raise FilterError(text, i + 1, f"number {raw!r} is out of range")
            out.append(_Tok("num", value, i, raw))
            i = end
            continue
        m = _NAME_RE.match(text, i)
        if m:
            word = m.group()
            kind = "kw" if word.lower() in _KEYWORDS else "name"
            out.append(_Tok(kind, word.lower() if kind == "kw" else word, i, word))
            i = m.end()
            continue
        raise FilterError(text, i + 1, f"unexpected character {c!r}")
    out.append(_Tok("end", None, n, ""))
    return out


def _string(text: str, start: int) -> tuple[str, int]:
    """A quoted string from ``start``: backslash escapes ``\\\\ \\" \\'``, or the quote doubled."""
    quote, i, parts = text[start], start + 1, []
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 < len(text) and text[i + 1] in "\\\"'":
                parts.append(text[i + 1])
                i += 2
                continue
            raise FilterError(text, i + 1, "unknown escape in string (use \\\\, \\\" or \\')")
        if c == quote:
            if i + 1 < len(text) and text[i + 1] == quote:
                parts.append(quote)
                i += 2
                continue
            return "".join(parts), i + 1
        parts.append(c)
        i += 1
    raise FilterError(text, start + 1, "string is not closed")


# --- the AST ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Field:
    name: str  # id, label, width, height, size, label_name, format, path, or tags
    tag: str | None = None

    @property
    def numeric(self) -> bool:
        return self.tag is None and self.name in _NUMBER_FIELDS.values()

    def __str__(self) -> str:
        if self.tag is None:
            return self.name
        return f"tags.{self.tag}" if _NAME_RE.fullmatch(self.tag) else f"tags.{_quote(self.tag)}"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lit(v: object) -> str:
    return _quote(v) if isinstance(v, str) else repr(v)


@dataclass(frozen=True, slots=True)
class Compare:
    field: Field
    op: str
    value: object

    def __str__(self) -> str:
        return f"{self.field} {self.op} {_lit(self.value)}"


@dataclass(frozen=True, slots=True)
class In:
    field: Field
    values: tuple

    def __str__(self) -> str:
        return f"{self.field} in ({', '.join(_lit(v) for v in self.values)})"


@dataclass(frozen=True, slots=True)
class Between:
    field: Field
    low: object
    high: object

    def __str__(self) -> str:
        return f"{self.field} between {_lit(self.low)} and {_lit(self.high)}"


@dataclass(frozen=True, slots=True)
class Glob:
    field: Field
    pattern: str

    def __str__(self) -> str:
        return f"{self.field} glob {_quote(self.pattern)}"


@dataclass(frozen=True, slots=True)
class Exists:
    field: Field

    def __str__(self) -> str:
        return f"{self.field} exists"


@dataclass(frozen=True, slots=True)
class Not:
    item: object

    def __str__(self) -> str:
        return f"not ({self.item})"


@dataclass(frozen=True, slots=True)
class And:
    items: tuple

    def __str__(self) -> str:
        return " and ".join(f"({i})" for i in self.items)


@dataclass(frozen=True, slots=True)
class Or:
    items: tuple

    def __str__(self) -> str:
        return " or ".join(f"({i})" for i in self.items)


Node = Compare | In | Between | Glob | Exists | Not | And | Or


@dataclass(frozen=True, slots=True)
class Filter:
    """A parsed filter: the text as given and its AST. ``canonical`` is the
    same filter written one way (whitespace, keyword case, quotes and ``==``
    normalised): two filters with equal ``canonical`` select the same ids."""

    text: str
    root: Node

    @property
    def canonical(self) -> str:
        return str(self.root)


# --- the parser ------------------------------------------------------------------------------------
class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    # helpers
    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def fail(self, tok: _Tok, reason: str) -> FilterError:
        return FilterError(self.text, tok.pos + 1, reason)

    def found(self, tok: _Tok) -> str:
        return "the end of the filter" if tok.kind == "end" else repr(tok.raw)

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def at(self, kind: str, value: object = None) -> bool:
        t = self.tok
        return t.kind == kind and (value is None or t.value == value)

    def expect(self, kind: str, value: object, what: str) -> _Tok:
        if not self.at(kind, value):
            raise self.fail(self.tok, f"expected {what}, found {self.found(self.tok)}")
        return self.take()

    # grammar
    def parse(self) -> Node:
        if self.at("end"):
            raise self.fail(self.tok, "the filter is empty")
        node = self.expr()
        if not self.at("end"):
            t = self.tok
            hint = " (join tests with 'and' or 'or')" if t.kind in ("name", "num", "str") else ""
            raise self.fail(t, f"unexpected {self.found(t)}{hint}")
        return node

    def expr(self) -> Node:
        items = [self.term()]
        while self.at("kw", "or"):
            self.take()
            items.append(self.term())
        return items[0] if len(items) == 1 else Or(tuple(items))

    def term(self) -> Node:
        items = [self.factor()]
        while self.at("kw", "and"):
            self.take()
            items.append(self.factor())
        return items[0] if len(items) == 1 else And(tuple(items))

    def factor(self) -> Node:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self.fail(self.tok, f"nested more than {_MAX_DEPTH} deep")
        try:
            if self.at("kw", "not"):
                self.take()
                return Not(self.factor())
            if self.at("op", "("):
                self.take()
                node = self.expr()
                self.expect("op", ")", "')'")
                return node
            return self.test()
        finally:
            self.depth -= 1

    def test(self) -> Node:
        t = self.tok
        if t.kind in ("num", "str"):
            return self.reversed_test()
        if t.kind != "name":
            raise self.fail(t, f"expected a field name, '(' or 'not', found {self.found(t)}")
        field, ftok = self.field()
        t = self.tok
        negated = False
        if t.kind == "kw" and t.value == "not":
            self.take()
            negated = True
            t = self.tok
            if not (t.kind == "kw" and t.value in ("in", "between", "glob")):
                raise self.fail(t, f"expected 'in', 'between' or 'glob' after 'not', found {self.found(t)}")
        if t.kind == "op" and t.value in _FLIP:
            op = self.take().value
            node: Node = Compare(field, op, self.value(field))
        elif t.kind == "kw" and t.value == "in":
            node = self.in_list(field)
        elif t.kind == "kw" and t.value == "between":
            self.take()
            low = self.value(field)
            self.expect("kw", "and", "'and' between the two ends of the range")
            node = Between(field, low, self.value(field))
        elif t.kind == "kw" and t.value == "glob":
            node = self.glob(field, ftok)
        elif t.kind == "kw" and t.value == "exists":
            self.take()
            if field.tag is None:
                raise self.fail(ftok, f"{field} is always there: 'exists' is for tags.KEY")
            node = Exists(field)
        else:
            raise self.fail(t, f"expected a comparison, 'in', 'between', 'glob' or 'exists' after {field}, "
                               f"found {self.found(t)}")
        return Not(node) if negated else node

    def reversed_test(self) -> Node:
        """``256 <= width`` and ``256 <= width <= 1024``."""
        vtok = self.take()
        t = self.tok
        if not (t.kind == "op" and t.value in _FLIP):
            raise self.fail(t, f"expected a comparison after the value {vtok.raw}, found {self.found(t)}")
        op = self.take().value
        if not self.at("name"):
            raise self.fail(self.tok, f"expected a field name after {op}, found {self.found(self.tok)}")
        field, _ = self.field()
        low = Compare(field, _FLIP[op], self.check(field, vtok))
        t = self.tok
        if not (t.kind == "op" and t.value in _FLIP):
            return low
        op2 = self.take().value
        if op not in ("<", "<=") or op2 not in ("<", "<="):
            raise self.fail(t, "a chained range goes low to high: use < or <= on both sides (256 <= width <= 1024)")
        return And((low, Compare(field, op2, self.value(field))))

    def field(self) -> tuple[Field, _Tok]:
        tok = self.take()
        name = tok.value
        if name == "tags":
            self.expect("op", ".", "'.' and a tag name after 'tags' (tags.source)")
            key = self.tok
            if key.kind in ("name", "kw", "str"):
                self.take()
                return Field("tags", key.raw if key.kind != "str" else key.value), tok
            raise self.fail(key, f"expected a tag name after 'tags.', found {self.found(key)}")
        if name in _NUMBER_FIELDS:
            return Field(_NUMBER_FIELDS[name]), tok
        if name in _TEXT_FIELDS:
            return Field(name), tok
        known = ", ".join([*_NUMBER_FIELDS, *sorted(_TEXT_FIELDS), "tags.KEY"])
        raise self.fail(tok, f"unknown field {name!r} (fields: {known})")

    def value(self, field: Field) -> object:
        t = self.tok
        if t.kind not in ("num", "str"):
            raise self.fail(t, f"expected a value for {field}, found {self.found(t)}")
        return self.check(field, self.take())

    def check(self, field: Field, vtok: _Tok) -> object:
        if field.numeric and vtok.kind != "num":
            hint = " (use label_name for the class name)" if field.name == "label" else ""
            raise self.fail(vtok, f"{field} is a number, got the text {vtok.raw}{hint}")
        if not field.numeric and vtok.kind != "str":
            raise self.fail(vtok, f"{field} is text, got the number {vtok.raw} (quote it: \"{vtok.raw}\")")
        return _norm(field, vtok.value)

    def in_list(self, field: Field) -> Node:
        self.take()
        self.expect("op", "(", "'(' after 'in'")
        values = [self.value(field)]
        while self.at("op", ","):
            self.take()
            if len(values) >= _MAX_IN_VALUES:
                raise self.fail(self.tok, f"more than {_MAX_IN_VALUES} values in one 'in' list")
            values.append(self.value(field))
        self.expect("op", ")", "',' or ')' in the 'in' list")
        return In(field, tuple(values))

    def glob(self, field: Field, ftok: _Tok) -> Node:
        self.take()
        t = self.tok
        if field.numeric:
            raise self.fail(ftok, f"{field} is a number: glob is for text fields (path, label_name, format, tags.KEY)")
        if t.kind != "str":
            raise self.fail(t, f"expected a quoted glob pattern, found {self.found(t)}")
        self.take()
        try:
            _compile_glob(t.value)
        except ValueError as exc:
            raise self.fail(t, f"bad glob pattern: {exc}") from None
        return Glob(field, t.value)


def parse_filter(text: str) -> Filter:
    """Parse ``text``; FilterError (a ConfigError) names the position of a mistake."""
    if not isinstance(text, str):
        raise ConfigError(f"filter must be text, not {type(text).__name__}")
    if len(text) > MAX_FILTER_CHARS:
        raise FilterError(text[:80], 1, f"the filter is {len(text)} characters long; the limit is {MAX_FILTER_CHARS}")
    return Filter(text, _Parser(text).parse())


# --- globs: segments, matched without regular expressions --------------------------------------------
_DOUBLE = object()  # a "**" segment


@lru_cache(maxsize=256)
def _compile_glob(pattern: str) -> tuple:
    """Segments: ``_DOUBLE`` or a tuple of atoms (a char, ``"?"``-any, ``"*"``-star, or a set)."""
    if not pattern:
        raise ValueError("the pattern is empty")
    segs = []
    for seg in pattern.split("/"):
        if seg == "**":
            if not segs or segs[-1] is not _DOUBLE:
                segs.append(_DOUBLE)
            continue
        atoms: list = []
        i = 0
        while i < len(seg):
            c = seg[i]
            if c == "*":
                while i + 1 < len(seg) and seg[i + 1] == "*":
                    i += 1
                atoms.append(("*",))
            elif c == "?":
                atoms.append(("?",))
            elif c == "[":
                end = seg.find("]", i + 2)
                if end < 0:
                    raise ValueError(f"'[' at {i + 1} of segment {seg!r} is not closed")
                body = seg[i + 1 : end]
                neg = body.startswith("!")
                if neg:
                    body = body[1:]
                ranges = []
                k = 0
                while k < len(body):
                    if k + 2 < len(body) and body[k + 1] == "-":
                        ranges.append((body[k], body[k + 2]))
                        k += 3
                    else:
                        ranges.append((body[k], body[k]))
                        k += 1
                atoms.append(("[", neg, tuple(ranges)))
                i = end
            else:
                atoms.append(c)
            i += 1
        segs.append(tuple(atoms))
    return tuple(segs)


def _atom_ok(atom, ch: str) -> bool:
    if isinstance(atom, str):
        return atom == ch
    if atom[0] == "?":
        return True
    _, neg, ranges = atom
    return any(lo <= ch <= hi for lo, hi in ranges) != neg


def _segment_match(atoms: tuple, s: str) -> bool:
    """Wildcard match of one segment: greedy with one backtrack point, O(len(atoms) * len(s))."""
    p = i = 0
    star_p, star_i = -1, 0
    while i < len(s):
        if p < len(atoms) and atoms[p] != ("*",) and _atom_ok(atoms[p], s[i]):
            p += 1
            i += 1
        elif p < len(atoms) and atoms[p] == ("*",):
            star_p, star_i = p, i
            p += 1
        elif star_p >= 0:
            p = star_p + 1
            star_i += 1
            i = star_i
        else:
            return False
    while p < len(atoms) and atoms[p] == ("*",):
        p += 1
    return p == len(atoms)


def glob_match(pattern: str, text: str) -> bool:
    """Whether ``text`` matches the glob ``pattern`` (see the module docs)."""
    return _segments_match(_compile_glob(pattern), text)


def _segments_match(segs: tuple, text: str) -> bool:
    parts = text.split("/")
    # reach[j]: the first k segments of the pattern can match the first j parts
    reach = [True] + [False] * len(parts)
    for seg in segs:
        if seg is _DOUBLE:
            for j in range(1, len(reach)):  # zero or more whole parts
                reach[j] = reach[j] or reach[j - 1]
        else:
            reach = [False] + [reach[j] and _segment_match(seg, parts[j]) for j in range(len(parts))]
    return reach[-1]


# --- evaluation --------------------------------------------------------------------------------------
Predicate = Callable[[SampleMeta], bool]


def compile_filter(flt: Filter, label_names: Sequence[str]) -> Predicate:
    """A predicate over one sample's metadata; ``label_names`` give ``label_name``."""
    names = tuple(label_names)
    return _compile(flt.root, names)


def _getter(field: Field, names: tuple[str, ...]) -> Callable[[SampleMeta], object]:
    if field.tag is not None:
        key = field.tag
        return lambda m: m.tags.get(key)
    if field.name == "label_name":
        return lambda m: names[m.label] if 0 <= m.label < len(names) else None
    if field.name == "format":
        return lambda m: m.format.upper()
    return operator.attrgetter(field.name)  # id, label, width, height, size, path


def _norm(field: Field, value: object) -> object:
    return value.upper() if field.tag is None and field.name == "format" and isinstance(value, str) else value


_CMP = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


def _compile(node: Node, names: tuple[str, ...]) -> Predicate:
    if isinstance(node, Or):
        parts = [_compile(n, names) for n in node.items]
        return lambda m: any(p(m) for p in parts)
    if isinstance(node, And):
        parts = [_compile(n, names) for n in node.items]
        return lambda m: all(p(m) for p in parts)
    if isinstance(node, Not):
        inner = _compile(node.item, names)
        return lambda m: not inner(m)
    get = _getter(node.field, names)
    if isinstance(node, Compare):
        value, cmp = _norm(node.field, node.value), _CMP[node.op]
        if node.op == "!=":
            return lambda m: (v := get(m)) is None or v != value
        return lambda m: (v := get(m)) is not None and cmp(v, value)
    if isinstance(node, In):
        values = frozenset(_norm(node.field, v) for v in node.values)
        return lambda m: get(m) in values
    if isinstance(node, Between):
        lo, hi = _norm(node.field, node.low), _norm(node.field, node.high)
        return lambda m: (v := get(m)) is not None and lo <= v <= hi
    if isinstance(node, Glob):
        segs = _compile_glob(_norm(node.field, node.pattern))
        return lambda m: (v := get(m)) is not None and _segments_match(segs, v)
    if isinstance(node, Exists):
        return lambda m: get(m) is not None
    raise TypeError(f"not a filter node: {node!r}")
