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

import numpy as np

__all__ = ["NO_ROUTE", "ROUTE_CODES", "LogProbs", "LossMask", "SamplerHeads", "TokenIds", "TokenRoutes", "route_code"]

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


# --- per-token payloads: rows of several numbers a token ---------------------------------------
# R3 routes and SC sampler heads are a fixed-width row per response token. They are kept as the
# little-endian bytes they travel and rest in: immutable, so sharing them is safe, and `view()` is
# a read-only memoryview over those very bytes (no copy; `torch.frombuffer`/`numpy.frombuffer`
# read it in place). A store record's bytes become a sample's payload without a copy either.

_HEAD_ID_WIDTH, _HEAD_LOGPROB_WIDTH = 4, 8  # int32 token ids, float64 log-probs (bit for bit, as LogProbs)
NO_ROUTE = -1  # an expert id for "no route recorded": environment tokens, tokens from before R3 was on

# R3 routes are packed in the smallest integer type that holds the model's expert ids: one byte an
# expert for up to 255 experts (Qwen3-30B-A3B's 128: 48 layers x top-8 = 384 bytes a token, a
# quarter of SGLang's int32), two for up to 32,767 (DeepSeek-V3's 256), four beyond. The rows are
# all ones bytes where no route was recorded: 255 in uint8, -1 in int16 and int32, so `unrouted`
# is the same fill whatever the type, and `NO_ROUTE` is what every reader of ids sees.
ROUTE_CODES = {"B": 1, "h": 2, "i": 4}  # `array`/`memoryview` item code -> bytes an expert id
_ROUTE_DTYPES = {"B": "<u1", "h": "<i2", "i": "<i4"}  # the same as numpy dtypes
_ROUTE_LIMIT = {"B": 255, "h": 2**15 - 1, "i": 2**31 - 1}  # expert ids below this fit (255 is uint8's NO_ROUTE)


def route_code(experts: int) -> str:
    """The item code of the smallest type that holds expert ids `0..experts - 1` and `NO_ROUTE`."""
    if experts < 1:
        raise ValueError(f"route_code: a model routes to at least 1 expert, got {experts}")
    return next(code for code in ROUTE_CODES if experts <= _ROUTE_LIMIT[code])


def _rows_of(name: str, data: bytes, row_bytes: int) -> int:
    if type(data) is not bytes:
        raise TypeError(f"{name}: data must be bytes (immutable), got {type(data).__name__}")
    if row_bytes <= 0 or len(data) % row_bytes:
        raise ValueError(f"{name}: {len(data)} bytes is not a whole number of {row_bytes}-byte rows")
    return len(data) // row_bytes


def _little_endian_view(name: str, data: bytes, code: str, shape: list[int]) -> memoryview:
    if not _LITTLE:
        raise NotImplementedError(f"{name}.view() reads little-endian bytes in place; this host is big-endian")
    raw: Any = memoryview(data)  # `cast` is typed per literal format code; ours is a variable
    view: memoryview = raw.cast(code) if not data else raw.cast(code, shape)  # no zero in a cast shape
    return view


class TokenRoutes:
    """R3: for each response token, the experts every MoE layer chose in the forward that sampled it.

    `[tokens, layers, top_k]` expert ids (SGLang's `routed_experts` rows, the row of position
    p - 1 for the token at position p), packed in `code`'s type (`ROUTE_CODES`: uint8, int16 or
    int32; `packed` picks it from the expert count). Rows of all ones bytes mark tokens no model
    forward sampled (environment tokens) or that were generated before routes were asked for:
    `NO_ROUTE` to every reader of ids (`tolist_flat`, `row`), 255 in a uint8 `view`/`array`.
    """

    __slots__ = ("_data", "code", "layers", "top_k")

    def __init__(self, data: bytes, *, layers: int, top_k: int, code: str = "i") -> None:
        if layers < 1 or top_k < 1:
            raise ValueError(f"TokenRoutes: layers={layers} and top_k={top_k} must both be >= 1")
        if code not in ROUTE_CODES:
            raise ValueError(f"TokenRoutes: item code {code!r} is not one of {sorted(ROUTE_CODES)} (uint8/int16/int32)")
        self.layers, self.top_k, self.code = layers, top_k, code
        _rows_of("TokenRoutes", data, layers * top_k * ROUTE_CODES[code])
        self._data = data

    @classmethod
    def packed(
        cls, int32_rows: bytes | memoryview, *, layers: int, top_k: int, experts: int | None = None
    ) -> TokenRoutes:
        """Rows of little-endian int32 ids (SGLang's form) packed into the smallest type that holds
        `experts` ids, or, with `experts` unknown, the largest id among them: one pass over the
        rows, the only copy between the wire and the store. Raises ValueError naming an id that is
        neither an expert of `experts` nor `NO_ROUTE`."""
        ids = np.frombuffer(int32_rows, dtype="<i4")
        if not ids.size:
            return cls(b"", layers=layers, top_k=top_k, code=route_code(experts or 1))
        low, high = int(ids.min()), int(ids.max())
        if low < NO_ROUTE or (experts is not None and high >= experts):
            bad = low if low < NO_ROUTE else high
            raise ValueError(
                f"TokenRoutes: expert id {bad} is outside 0..{'' if experts is None else experts - 1} "
                f"(or {NO_ROUTE} for no route){'' if experts is None else f' of a model with {experts} experts'}"
            )
        code = route_code(experts if experts is not None else high + 1)
        data = (ids if code == "i" else ids.astype(_ROUTE_DTYPES[code])).tobytes()  # -1 wraps to 255 in uint8
        return cls(data, layers=layers, top_k=top_k, code=code)

    @classmethod
    def unrouted(cls, n: int, *, layers: int, top_k: int, code: str = "i") -> TokenRoutes:
        """`n` rows of `NO_ROUTE`."""
        return cls(b"\xff" * (n * layers * top_k * ROUTE_CODES[code]), layers=layers, top_k=top_k, code=code)

    @property
    def data(self) -> bytes:
        """The rows as little-endian bytes of `code`'s type (the store's form)."""
        return self._data

    @property
    def itemsize(self) -> int:
        """Bytes an expert id: 1, 2 or 4."""
        return ROUTE_CODES[self.code]

    def __len__(self) -> int:
        return len(self._data) // (self.layers * self.top_k * ROUTE_CODES[self.code])

    def view(self) -> memoryview:
        """A read-only `[tokens, layers, top_k]` view of the bytes in `code`'s type, without a copy."""
        return _little_endian_view("TokenRoutes", self._data, self.code, [len(self), self.layers, self.top_k])

    def array(self) -> np.ndarray[Any, Any]:
        """A read-only numpy `[tokens, layers, top_k]` array over the bytes, without a copy (uint8
        rows hold 255 where `NO_ROUTE` is meant: `as_ids` widens and maps it)."""
        flat = np.frombuffer(self._data, dtype=_ROUTE_DTYPES[self.code])
        return flat.reshape(len(self), self.layers, self.top_k)

    def as_ids(self, dtype: Any = np.int64) -> np.ndarray[Any, Any]:
        """The ids widened to `dtype` (a signed type; int64 is what torch's `gather` indexes with),
        `NO_ROUTE` as -1: one new array, the only copy between the store's bytes and a trainer's plan."""
        wide = self.array().astype(dtype)
        if self.code == "B":
            wide[wide == 255] = NO_ROUTE
        return wide

    def unrouted_rows(self) -> int:
        """Rows marked `NO_ROUTE` (tokens no sampling forward routed)."""
        if not self._data:
            return 0
        first = self.array()[:, 0, 0]
        return int(np.count_nonzero(first == (255 if self.code == "B" else NO_ROUTE)))

    def rows(self, start: int, end: int) -> TokenRoutes:
        row = self.layers * self.top_k * ROUTE_CODES[self.code]
        return TokenRoutes(self._data[start * row : end * row], layers=self.layers, top_k=self.top_k, code=self.code)

    def row(self, t: int) -> list[list[int]]:
        """Token `t`'s experts, a list of `top_k` ids per layer (`NO_ROUTE` where none was recorded)."""
        flat = self.rows(t, t + 1).tolist_flat()
        return [flat[i * self.top_k : (i + 1) * self.top_k] for i in range(self.layers)]

    def tolist_flat(self) -> list[int]:
        ids: list[int] = self.as_ids().reshape(-1).tolist()
        return ids

    def widened(self, code: str) -> TokenRoutes:
        """The same ids in `code`'s type, which must hold them (a copy, unless it is this type)."""
        if code == self.code:
            return self
        if ROUTE_CODES[code] < ROUTE_CODES[self.code]:
            raise ValueError(f"TokenRoutes: cannot narrow {self.code!r} routes to {code!r}")
        data = self.as_ids(_ROUTE_DTYPES[code]).tobytes()
        return TokenRoutes(data, layers=self.layers, top_k=self.top_k, code=code)

    def joined(self, other: TokenRoutes) -> TokenRoutes:
        if (other.layers, other.top_k) != (self.layers, self.top_k):
            raise ValueError(
                f"TokenRoutes: cannot append rows of {other.layers} layers x top-{other.top_k} to rows of "
                f"{self.layers} layers x top-{self.top_k} (the engine's model changed?)"
            )
        if not other._data:
            return self
        if not self._data:
            return other
        if other.code != self.code:  # a wider id arrived (expert count unknown): both in the wider type
            code = max(self.code, other.code, key=ROUTE_CODES.__getitem__)
            return self.widened(code).joined(other.widened(code))
        return TokenRoutes(self._data + other._data, layers=self.layers, top_k=self.top_k, code=self.code)

    def __eq__(self, other: object) -> bool:
        # The same ids are equal in any type (a uint8 NO_ROUTE is an int32 one).
        if not isinstance(other, TokenRoutes):
            return NotImplemented
        if (self.layers, self.top_k, len(self)) != (other.layers, other.top_k, len(other)):
            return False
        if self.code == other.code:
            return self._data == other._data
        return bool(np.array_equal(self.as_ids(), other.as_ids()))

    def __hash__(self) -> int:
        return hash((self.layers, self.top_k, self.widened("i")._data))

    def __repr__(self) -> str:
        dtype = {"B": "uint8", "h": "int16", "i": "int32"}[self.code]
        return f"TokenRoutes({len(self)} tokens x {self.layers} layers x top-{self.top_k}, {dtype})"

    def __copy__(self) -> TokenRoutes:
        return self

    def __deepcopy__(self, memo: object) -> TokenRoutes:
        return self


class SamplerHeads:
    """SC: for each response token, the sampler's top-k candidates at that step: token ids and log-probs.

    Two row-aligned arrays, int32 ids and float64 log-probs, each `[tokens, k]` (SGLang's
    `output_top_logprobs`, one entry per output token). Rows of id -1 and log-prob 0.0 mark
    tokens no sampler produced (environment tokens).
    """

    __slots__ = ("_ids", "_logprobs", "k")

    def __init__(self, token_ids: bytes, logprobs: bytes, *, k: int) -> None:
        if k < 1:
            raise ValueError(f"SamplerHeads: k={k} must be >= 1")
        self.k = k
        n_ids = _rows_of("SamplerHeads token ids", token_ids, k * _HEAD_ID_WIDTH)
        n_lps = _rows_of("SamplerHeads log-probs", logprobs, k * _HEAD_LOGPROB_WIDTH)
        if n_ids != n_lps:
            raise ValueError(f"SamplerHeads: {n_ids} rows of token ids but {n_lps} rows of log-probs")
        self._ids, self._logprobs = token_ids, logprobs

    @classmethod
    def unsampled(cls, n: int, *, k: int) -> SamplerHeads:
        return cls(b"\xff" * (n * k * _HEAD_ID_WIDTH), bytes(n * k * _HEAD_LOGPROB_WIDTH), k=k)

    @property
    def token_ids_data(self) -> bytes:
        return self._ids

    @property
    def logprobs_data(self) -> bytes:
        return self._logprobs

    def __len__(self) -> int:
        return len(self._ids) // (self.k * _HEAD_ID_WIDTH)

    def token_ids_view(self) -> memoryview:
        """A read-only `[tokens, k]` int32 view, without a copy."""
        return _little_endian_view("SamplerHeads", self._ids, "i", [len(self), self.k])

    def logprobs_view(self) -> memoryview:
        """A read-only `[tokens, k]` float64 view, without a copy."""
        return _little_endian_view("SamplerHeads", self._logprobs, "d", [len(self), self.k])

    def rows(self, start: int, end: int) -> SamplerHeads:
        a, b = self.k * _HEAD_ID_WIDTH, self.k * _HEAD_LOGPROB_WIDTH
        return SamplerHeads(self._ids[start * a : end * a], self._logprobs[start * b : end * b], k=self.k)

    def row(self, t: int) -> list[tuple[int, float]]:
        """Token `t`'s candidates as (token id, log-prob), in the engine's order."""
        one = self.rows(t, t + 1)
        ids = struct.unpack(f"<{self.k}i", one._ids)
        lps = struct.unpack(f"<{self.k}d", one._logprobs)
        return list(zip(ids, lps, strict=True))

    def joined(self, other: SamplerHeads) -> SamplerHeads:
        if other.k != self.k:
            raise ValueError(f"SamplerHeads: cannot append top-{other.k} rows to top-{self.k} rows")
        if not other._ids:
            return self
        if not self._ids:
            return other
        return SamplerHeads(self._ids + other._ids, self._logprobs + other._logprobs, k=self.k)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplerHeads):
            return NotImplemented
        return (self.k, self._ids, self._logprobs) == (other.k, other._ids, other._logprobs)

    def __hash__(self) -> int:
        return hash((self.k, self._ids, self._logprobs))

    def __repr__(self) -> str:
        return f"SamplerHeads({len(self)} tokens x top-{self.k})"

    def __copy__(self) -> SamplerHeads:
        return self

    def __deepcopy__(self, memo: object) -> SamplerHeads:
        return self
