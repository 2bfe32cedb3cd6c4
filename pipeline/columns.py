"""Per-token columns: a sample's response token ids, log-probs and loss mask as read-only arrays.

Why not tuples: a 1k-token answer as two tuples is 2,000 Python objects (an int and a float per
token) that the parser creates, the codec packs one by one, the garbage collector walks and the
trainer frees one by one; that was most of the controller's CPU per sample after parsing itself
(BENCHMARKS.md section 3). As arrays a column is one allocation: 4 bytes a token id, 8 a log-prob,
1 a mask entry; stored and read back with one copy (`to_bytes`, `from_bytes`: the codec), turned
into a tensor without a loop (`torch.frombuffer`), invisible to the collector.

They behave as the tuples they replace, so rewards, agents and tests that read samples need no
change: `len`, indexing, iteration, `in`, slicing (a column again); `==` and `hash` agree with a
tuple of the same values (`TokenIds([1, 2]) == (1, 2)`); `+` with a tuple or another column gives
a column, on either side; `+=` rebinds, as it does for a tuple. They are read-only: every method
that would change one in place raises TypeError (a sample changes only by building the next one,
`Sample.extended`). What a tuple does and they do not: `isinstance(x, tuple)`, and JSON encoders
that know only lists and tuples (`orjson.dumps(col.tolist())`). The buffer they expose (for
`torch.frombuffer`, `numpy.frombuffer`) must be copied before it is written to.

    TokenIds   int32    (`array` 'i')
    LogProbs   float64  (`array` 'd'): the engine's log-probs round-trip bit for bit
    LossMask   uint8    (`array` 'B'): 1 = the token trains
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Self, SupportsIndex

__all__ = ["LogProbs", "LossMask", "TokenIds"]

if TYPE_CHECKING:
    _Ints = array[int]
    _Floats = array[float]
else:  # `array` takes no type parameters at run time before Python 3.12
    _Ints = _Floats = array

_array: Any = array  # `array`'s own methods, called on a column without its overrides (untyped)
_LITTLE = sys.byteorder == "little"
# One compiled Struct per (code, length): building the format string and looking it up in struct's
# own cache costs as much as packing 1k numbers. Bounded: lengths are few.
_STRUCTS: dict[tuple[str, int], struct.Struct] = {}


def _struct(code: str, n: int) -> struct.Struct:
    compiled = _STRUCTS.get((code, n))
    if compiled is None:
        if len(_STRUCTS) >= 8192:
            _STRUCTS.clear()
        compiled = _STRUCTS[code, n] = struct.Struct(f"<{n}{code}")
    return compiled


class _Column:
    """The behaviour the three columns share (a mixin before `array` in their bases)."""

    __slots__ = ()
    code: ClassVar[str]  # the `array` typecode
    kind: ClassVar[str]  # what an item is, for errors
    width: ClassVar[int]  # bytes an item
    _pack: ClassVar[str]  # the little-endian `struct` code of the same width

    def __new__(cls, values: Iterable[Any] = ()) -> Self:
        if isinstance(values, cls):
            return values  # read-only: sharing is safe, as for a tuple
        if isinstance(values, (tuple, list)):
            # struct packs a tuple of numbers about twice as fast as `array` reads one (it checks
            # each type and range alike); anything it refuses goes to `array` for its own error.
            try:
                return cls._made(_struct(cls._pack, len(values)).pack(*values))
            except struct.error:
                pass
        if isinstance(values, (bytes, bytearray, memoryview)):
            raise TypeError(f"{cls.__name__}: raw bytes are read with {cls.__name__}.from_bytes, not the constructor")
        try:
            return cls._made(values)
        except OverflowError as exc:
            raise OverflowError(f"{cls.__name__} holds {cls.kind}: a value is out of range ({exc})") from None

    @classmethod
    def _made(cls, initial: Any) -> Self:
        column: Self = _array.__new__(cls, cls.code, initial)
        return column

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Self:
        """A column from its little-endian items (what `to_bytes` wrote): one copy."""
        if len(data) % cls.width:
            raise ValueError(f"{cls.__name__}: {len(data)} bytes is not a whole number of {cls.width}-byte items")
        column = cls._made(data)
        if not _LITTLE:
            _array.byteswap(column)
        return column

    @classmethod
    def zeros(cls, n: int) -> Self:
        return cls._made(bytes(n * cls.width))

    def to_bytes(self) -> bytes:
        """The items as little-endian bytes (the codec's form): one copy."""
        swapped: Any = self
        if not _LITTLE:
            swapped = array(self.code, _array.tolist(self))
            swapped.byteswap()
        data: bytes = _array.tobytes(swapped)
        return data

    # -- a tuple's behaviour ----------------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        item = _array.__getitem__(self, index)
        return type(self)(item) if type(index) is slice else item

    def __add__(self, other: object) -> Self:
        if isinstance(other, (array, tuple, list)):
            return self._joined(self, type(self)(other))
        return NotImplemented

    def __radd__(self, other: object) -> Self:
        if isinstance(other, (array, tuple, list)):
            return self._joined(type(self)(other), self)
        return NotImplemented

    @classmethod
    def _joined(cls, head: Self, tail: Self) -> Self:
        # An empty side gives the other back, as `() + t` does for tuples: a sample's first
        # segment costs no copy. Otherwise one copy of each side.
        if not _array.__len__(tail):
            return head
        if not _array.__len__(head):
            return tail
        joined = cls._made(head)
        _array.extend(joined, tail)
        return joined

    def __iadd__(self, other: object) -> Self:
        return self.__add__(other)  # rebinds, as `+=` on a tuple does

    def __mul__(self, n: SupportsIndex) -> Self:
        return type(self)(_array.__mul__(self, n))

    __rmul__ = __mul__

    def __imul__(self, n: SupportsIndex) -> Self:
        return self.__mul__(n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, array):
            return bool(_array.__eq__(self, other))
        if isinstance(other, tuple):
            same: bool = len(other) == _array.__len__(self) and _array.tolist(self) == list(other)
            return same
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(tuple(_array.tolist(self)))  # as the equal tuple hashes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_array.tolist(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_bytes, (self.to_bytes(),))

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: object) -> Self:
        return self

    # -- read-only ----------------------------------------------------------------------------------
    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} is read-only, like the tuple it stands for: build a new one "
            "(a sample's columns change only through Sample.extended and friends)"
        )

    __setitem__ = __delitem__ = append = extend = insert = pop = remove = reverse = _read_only
    byteswap = frombytes = fromlist = fromfile = fromunicode = _read_only


class TokenIds(_Column, _Ints):  # type: ignore[misc]  # hashable, unlike `array`
    """Token ids, int32."""

    __slots__ = ()
    code = "i"
    _pack = "i"
    kind = "int32 token ids"


class LogProbs(_Column, _Floats):  # type: ignore[misc]  # hashable, unlike `array`
    """Log-probs, float64."""

    __slots__ = ()
    code = "d"
    _pack = "d"
    kind = "float64 log-probs"


class LossMask(_Column, _Ints):  # type: ignore[misc]  # hashable, unlike `array`
    """Loss mask entries, uint8: 1 = the token trains, 0 = transcript only."""

    __slots__ = ()
    code = "B"
    _pack = "B"
    kind = "uint8 mask entries (0 or 1)"

    @classmethod
    def ones(cls, n: int) -> LossMask:
        return cls._made(b"\x01" * n)

    def all_ones(self) -> bool:
        # bytes.count of one byte value runs in C over the raw buffer: 50x `array.count`'s compares.
        ones: bool = _array.tobytes(self).count(1) == len(self)
        return ones


for _column in (TokenIds, LogProbs, LossMask):
    _column.width = struct.calcsize(_column._pack)
    if array(_column.code).itemsize != _column.width:  # the codec's on-disk layout relies on it
        raise ImportError(
            f"{_column.__name__}: array {_column.code!r} items are not {_column.width} bytes on this platform"
        )
