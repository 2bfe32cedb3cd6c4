"""Records to bytes and back: msgpack for structure, raw little-endian arrays for per-token data.

Every record is a msgpack array that starts `[SCHEMA_VERSION, kind, ...]`, so a record of another
schema or another kind is refused instead of misread. Per-token arrays are packed as raw
little-endian bytes (response and prompt ids int32, log-probs float64 so they round-trip bit for
bit, loss mask uint8, or nil when it is all ones): the smallest form, and a sample's columns
(`core.columns`) are already arrays of exactly that layout, so each is written and read back
with one copy. Prompt ids stay tuples (one per group) and are packed the same way.
R3 routes and SC sampler heads, where a sample has them, are a 13th sample field: their rows'
bytes with their shape, wrapped on read without a further copy (`TokenRoutes`, `SamplerHeads`).
A sample without them is the 12-field record that code from before them reads too. Routes are
packed (one byte an expert id for models of up to 255 experts, `core.columns.route_code`) and
name their item code: `[layers, top_k, data, code]`; the three-field form of the first payload
records is int32 and still read.
Where the cost hides now: msgpack and the dataclasses, a few microseconds a sample; before the
columns, decoding a group of 8 x 1k tokens built 16k int and float objects (0.6 ms on a slow core).

Never pickle: a record must stay readable by a later version of this code and must not execute
anything when read.

Decoding anything that is not a record this code wrote (truncated, another schema, garbage) raises
`CorruptRecordError` naming the key it was read from. Encoding something that cannot be stored (a
token id outside int32, a metadata value that is not JSON-like) raises `StoreError` naming the group.

Free-form values (`PromptTask.label`, `metadata`, `RunMeta.extra`) are JSON-like: None, bool, int,
float, str, bytes, lists and str-keyed dicts. Tuples inside them come back as lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgpack

from core.columns import LogProbs, LossMask, SamplerHeads, TokenIds, TokenRoutes
from core.errors import CorruptRecordError, StoreError
from core.types import Batch, FinishReason, Group, PromptTask, Sample, SampleStatus, VersionSpan

from .protocol import SCHEMA_VERSION, Cursor, RunMeta

__all__ = [
    "decode_batch",
    "decode_batch_ref",
    "decode_cursor",
    "decode_group",
    "decode_meta",
    "encode_batch",
    "encode_batch_ref",
    "encode_cursor",
    "encode_group",
    "encode_meta",
    "meta_difference",
]

_GROUP, _BATCH, _BATCH_REF, _CURSOR, _META = "group", "batch", "batch_ref", "cursor", "meta"

_STATUS = {s.value: s for s in SampleStatus}
_FINISH = {f.value: f for f in FinishReason}


class _Malformed(Exception):
    """A record that parsed as msgpack but is not what this code writes."""


_T = TypeVar("_T")


def _packb(obj: object, **options: Any) -> bytes:
    """msgpack's `packb`, typed: it returns bytes whenever it is not given a stream."""
    data: bytes = msgpack.packb(obj, **options)
    return data


def _pack_prompt(prompt_ids: Sequence[int]) -> bytes:
    # Prompt ids stay a tuple in a sample (one a group, shared); packed the way the columns are.
    return TokenIds(prompt_ids).to_bytes()


def _prompt_from(data: bytes) -> tuple[int, ...]:
    return tuple(TokenIds.from_bytes(data).tolist())


# --- groups -----------------------------------------------------------------------------------


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return mapping if type(mapping) is dict else dict(mapping)


def _sample_record(s: Sample, task_prompt: tuple[int, ...]) -> list[Any]:
    # Samples almost always share their task's prompt tuple: store it once, per group.
    same_prompt = s.prompt_ids is task_prompt or s.prompt_ids == task_prompt
    rec = [
        s.index,
        None if same_prompt else _pack_prompt(s.prompt_ids),
        s.response_ids.to_bytes(),
        s.logprobs.to_bytes(),
        None if s.loss_mask.all_ones() else s.loss_mask.to_bytes(),  # almost every mask is all ones
        [x for span in s.spans for x in (span.start, span.end, span.version)],
        s.status.value,
        None if s.finish_reason is None else s.finish_reason.value,
        s.reward,
        s.error,
        list(s.resumed_at),
        _plain(s.metadata),
    ]
    # The 13th field only where there is a payload: a run without R3/SC writes the records that
    # code from before payloads reads too.
    if s.routes is not None or s.heads is not None:
        rec.append(_payloads_record(s))
    return rec


def _payloads_record(s: Sample) -> dict[str, Any]:
    # R3 routes and SC heads are stored as the raw bytes they hold (little-endian int32/float64
    # rows) with their shape; read back, the payload wraps the record's bytes without a copy.
    rec: dict[str, Any] = {}
    if s.routes is not None:
        # Payload schema 2: the packed ids' item code last (ROUTE_CODES). Schema 1 records (three
        # fields, int32 ids) are read as they are: stores written before packing open and replay.
        rec["r3"] = [s.routes.layers, s.routes.top_k, s.routes.data, s.routes.code]
    if s.heads is not None:
        rec["sc"] = [s.heads.k, s.heads.token_ids_data, s.heads.logprobs_data]
    return rec


def _payloads_from(rec: Any) -> tuple[TokenRoutes | None, SamplerHeads | None]:
    if rec is None:
        return None, None
    if type(rec) is not dict or not set(rec) <= {"r3", "sc"}:
        raise _Malformed(f"per-token payloads are not a map of r3/sc: {rec!r:.80}")
    routes = heads = None
    if "r3" in rec:
        r3 = rec["r3"]
        if type(r3) is not list or len(r3) not in (3, 4):
            raise _Malformed(f"R3 routes are not [layers, top_k, data(, code)]: {r3!r:.80}")
        layers, top_k, data = r3[:3]
        routes = TokenRoutes(data, layers=layers, top_k=top_k, code=r3[3] if len(r3) == 4 else "i")
    if "sc" in rec:
        k, ids, logprobs = rec["sc"]
        heads = SamplerHeads(ids, logprobs, k=k)
    return routes, heads


def encode_group(group: Group) -> bytes:
    """A group as one record. Raises StoreError (naming the group) if something cannot be stored."""
    try:
        task = group.task
        prompt = task.prompt_ids
        return _packb(
            [
                SCHEMA_VERSION,
                _GROUP,
                group.group_id,
                group.epoch,
                group.admitted_version,
                group.seq,
                group.rejected_reason,
                task.index,
                _pack_prompt(prompt),
                task.label,
                _plain(task.metadata),
                [_sample_record(s, prompt) for s in group.samples],
            ],
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"group {group.group_id!r} cannot be encoded: {exc}") from exc


def _sample_from(rec: Any, task_prompt: tuple[int, ...]) -> Sample:
    # 12 fields: records written before per-token payloads (R3/SC) existed; they read as none.
    if type(rec) is not list or len(rec) not in (12, 13):
        raise _Malformed("a sample is not a 12- or 13-field array")
    (index, prompt, response, logprobs, mask, flat_spans, status, finish, reward, error, resumed, meta) = rec[:12]
    routes, heads = _payloads_from(rec[12] if len(rec) == 13 else None)
    if len(flat_spans) % 3:
        raise _Malformed(f"{len(flat_spans)} span numbers is not a multiple of 3")
    spans = tuple(VersionSpan(*flat_spans[i : i + 3]) for i in range(0, len(flat_spans), 3))
    response_ids = TokenIds.from_bytes(response)
    return Sample(
        index=index,
        prompt_ids=task_prompt if prompt is None else _prompt_from(prompt),
        response_ids=response_ids,
        logprobs=LogProbs.from_bytes(logprobs),
        loss_mask=LossMask.ones(len(response_ids)) if mask is None else LossMask.from_bytes(mask),
        spans=spans,
        status=_STATUS[status],
        finish_reason=None if finish is None else _FINISH[finish],
        reward=reward,
        error=error,
        resumed_at=tuple(resumed),
        metadata=meta,
        routes=routes,
        heads=heads,
    )


def _header(rec: Any, kind: str, fields: int) -> list[Any]:
    if type(rec) is not list or len(rec) < 2:
        raise _Malformed("not a record array")
    if rec[0] != SCHEMA_VERSION:
        raise _Malformed(f"schema version {rec[0]!r}, this code reads {SCHEMA_VERSION}")
    if rec[1] != kind:
        raise _Malformed(f"a {rec[1]!r} record where a {kind!r} record was expected")
    if len(rec) != fields:
        raise _Malformed(f"a {kind} record of {len(rec)} fields, expected {fields}")
    return rec


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _group_from(rec: Any) -> Group:
    _, _, group_id, epoch, admitted, seq, rejected, t_index, t_prompt, label, t_meta, samples = _header(rec, _GROUP, 12)
    if type(samples) is not list:
        raise _Malformed("samples are not an array")
    prompt = _prompt_from(t_prompt)
    task = PromptTask(index=t_index, prompt_ids=prompt, label=label, metadata=t_meta)
    return Group(
        group_id=group_id,
        task=task,
        epoch=epoch,
        samples=tuple(_sample_from(s, prompt) for s in samples),
        admitted_version=admitted,
        seq=seq,
        rejected_reason=rejected,
    )


def _decoding(key: bytes | str, data: bytes, build: Callable[[Any], _T]) -> _T:
    try:
        return build(_unpackb(data))
    except Exception as exc:  # anything at all that fails to decode is a corrupt record
        raise CorruptRecordError(key, f"{type(exc).__name__}: {exc}") from exc


def decode_group(data: bytes, *, key: bytes | str = "<group>") -> Group:
    return _decoding(key, data, _group_from)


# --- batches ----------------------------------------------------------------------------------


def encode_batch(batch: Batch) -> bytes:
    """A whole batch, groups included (for handing a batch over or saving it outside a store)."""
    groups = [encode_group(g) for g in batch.groups]
    return _packb([SCHEMA_VERSION, _BATCH, batch.step, groups], use_bin_type=True)


def decode_batch(data: bytes, *, key: bytes | str = "<batch>") -> Batch:
    def build(rec: Any) -> Batch:
        _, _, step, groups = _header(rec, _BATCH, 4)
        return Batch(step=step, groups=tuple(_group_from(_unpackb(g)) for g in groups))

    return _decoding(key, data, build)


def encode_batch_ref(step: int, group_ids: Sequence[str]) -> bytes:
    """A batch as the store keeps it: its step and its group ids in order (the groups live once)."""
    return _packb([SCHEMA_VERSION, _BATCH_REF, step, list(group_ids)], use_bin_type=True)


def decode_batch_ref(data: bytes, *, key: bytes | str = "<batch_ref>") -> tuple[int, tuple[str, ...]]:
    def build(rec: Any) -> tuple[int, tuple[str, ...]]:
        _, _, step, ids = _header(rec, _BATCH_REF, 4)
        if type(step) is not int or type(ids) is not list or not all(type(i) is str for i in ids):
            raise _Malformed("a batch reference needs an int step and a list of group ids")
        return step, tuple(ids)

    return _decoding(key, data, build)


# --- cursor and run metadata ------------------------------------------------------------------


def encode_cursor(cursor: Cursor) -> bytes:
    return _packb([SCHEMA_VERSION, _CURSOR, cursor.epoch, cursor.index, cursor.next_seq])


def decode_cursor(data: bytes, *, key: bytes | str = "<cursor>") -> Cursor:
    def build(rec: Any) -> Cursor:
        _, _, epoch, index, next_seq = _header(rec, _CURSOR, 5)
        if not all(type(v) is int for v in (epoch, index, next_seq)):
            raise _Malformed("cursor fields are not integers")
        return Cursor(epoch=epoch, index=index, next_seq=next_seq)

    return _decoding(key, data, build)


def encode_meta(meta: RunMeta) -> bytes:
    try:
        return _packb(
            [
                SCHEMA_VERSION,
                _META,
                meta.run_id,
                meta.dataset_fingerprint,
                meta.tokenizer_fingerprint,
                meta.n_samples_per_prompt,
                meta.schema_version,
                _plain(meta.extra),
            ],
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"run metadata for run {meta.run_id!r} cannot be encoded: {exc}") from exc


def decode_meta(data: bytes, *, key: bytes | str = "<meta>") -> RunMeta:
    def build(rec: Any) -> RunMeta:
        _, _, run_id, dataset_fp, tokenizer_fp, n_samples, schema, extra = _header(rec, _META, 8)
        if type(extra) is not dict:
            raise _Malformed("run metadata `extra` is not a map")
        return RunMeta(
            run_id=run_id,
            dataset_fingerprint=dataset_fp,
            tokenizer_fingerprint=tokenizer_fp,
            n_samples_per_prompt=n_samples,
            schema_version=schema,
            extra=extra,
        )

    return _decoding(key, data, build)


def meta_difference(stored: RunMeta, given: RunMeta) -> tuple[str, Any, Any] | None:
    """The first field that names the run in which two run records differ, as (field, stored,
    given); None if they name the same run.

    Both stores use it so that `write_meta` refuses the same things with the same message. `extra`
    (the settings in force and the record of their changes) describes the run and may be
    rewritten: which changed setting a resume accepts is the launcher's decision.
    """
    for name in ("run_id", "dataset_fingerprint", "tokenizer_fingerprint", "n_samples_per_prompt", "schema_version"):
        if getattr(stored, name) != getattr(given, name):
            return name, getattr(stored, name), getattr(given, name)
    return None
