"""The packing arguments of a view or a coordinator's run: validated once, kept as
:class:`PackOptions`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..checks import is_int

if TYPE_CHECKING:
    from ..plan.table import TableRef


@dataclass(frozen=True)
class PackOptions:
    """Validated packing arguments (``blocks_per_epoch`` may still be ``"auto"``)."""

    block_len: int
    eos_id: int
    pad_id: int
    blocks_per_epoch: int | str
    column: str
    position_ids: bool = False
    cu_seqlens: bool = False


TRANSFORM_REFUSED = "transform cannot be combined with pack_sequences"


def pack_options(table: TableRef, columns: list[str] | None, transform: object,
                 num_splits: int, pack_sequences: int | None, eos_id: int | None,
                 pad_id: int | None, blocks_per_epoch: int | str | None,
                 position_ids: bool = False, cu_seqlens: bool = False) -> PackOptions | None:
    """The reference's packing validation, plus clear errors where it is silent."""
    if pack_sequences is None and (position_ids or cu_seqlens):
        raise ValueError("pack_position_ids and pack_cu_seqlens require pack_sequences")
    if not check_pack_arguments(num_splits, pack_sequences, eos_id, pad_id, blocks_per_epoch):
        return None
    if transform is not None:
        raise ValueError(TRANSFORM_REFUSED)
    if columns is None or len(columns) != 1:
        raise ValueError("pack_sequences requires columns to name exactly one list-typed "
                         f"column of token ids, got columns={columns!r}")
    kind = table.schema().field(columns[0]).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind)):
        raise ValueError(f"pack_sequences requires a list-typed token column; {columns[0]} "
                         f"has type {kind}")
    if not pa.types.is_integer(kind.value_type):
        raise ValueError("pack_sequences requires a token column with integer values; "
                         f"{columns[0]} has value type {kind.value_type}")
    return PackOptions(pack_sequences, eos_id, pad_id, blocks_per_epoch,  # type: ignore[arg-type]
                       columns[0], bool(position_ids), bool(cu_seqlens))


def check_pack_arguments(num_splits: int, pack_sequences: int | None, eos_id: int | None,
                         pad_id: int | None, blocks_per_epoch: int | str | None) -> bool:
    """Validate the packing arguments that need no table; returns whether packing is on."""
    if pack_sequences is None:
        if blocks_per_epoch is not None:
            raise ValueError("blocks_per_epoch requires pack_sequences")
        return False
    check_token_ids(pack_sequences, eos_id, pad_id)
    if blocks_per_epoch is None:
        raise ValueError("blocks_per_epoch is required when pack_sequences is set (an "
                         "integer, or 'auto' to count the epoch's tokens)")
    if blocks_per_epoch != "auto":
        if not is_int(blocks_per_epoch):
            raise ValueError("blocks_per_epoch must be a positive integer or 'auto'")
        assert isinstance(blocks_per_epoch, int)
        if blocks_per_epoch <= 0:
            raise ValueError("blocks_per_epoch must be greater than 0")
        if blocks_per_epoch % num_splits:
            near = blocks_per_epoch - blocks_per_epoch % num_splits or num_splits
            raise ValueError(f"blocks_per_epoch ({blocks_per_epoch}) must be divisible by "
                             f"num_splits ({num_splits}); every split emits the same number "
                             f"of blocks (e.g. blocks_per_epoch={near})")
    return True


def check_token_ids(pack_sequences: object, eos_id: object, pad_id: object) -> None:
    """Refuse, naming the fix, a block length or token ids that packing cannot use."""
    if not is_int(pack_sequences) or pack_sequences <= 0:
        raise ValueError(f"pack_sequences must be greater than 0 (an integer block length), "
                         f"got {pack_sequences!r}")
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is None:
            raise ValueError(f"{name} is required when pack_sequences is set")
        if not is_int(value):
            raise ValueError(f"{name} must be an integer token id, got {value!r}")
        if not -2**63 <= value < 2**63:
            raise ValueError(f"{name} {value} does not fit in the int64 blocks "
                             "pack_sequences makes; token ids must be int64")
    if eos_id == pad_id:
        raise ValueError(f"eos_id and pad_id are both {eos_id}: padding is masked by "
                         "input_ids == pad_id, so pad_id must be a token reserved for padding")


RUN_PACKING_ARGUMENTS = ("pack_sequences", "eos_id", "pad_id", "blocks_per_epoch")


def refuse_unsupported(arguments: dict[str, Any]) -> None:
    """``from_coordinator``'s refusal of arguments it does not take, naming where the
    run's packing arguments go."""
    packing = [a for a in arguments if a in RUN_PACKING_ARGUMENTS]
    if packing:
        raise ValueError(
            f"from_coordinator takes no {', '.join(packing)}: packing belongs to the run, so "
            "pass them (with columns=[token column]) to Coordinator.create(...), and every "
            "attached view packs those blocks (docs/packing.md)")
    if arguments:
        raise TypeError(f"from_coordinator() got unexpected keyword arguments: "
                        f"{', '.join(sorted(arguments))}")


def attached_packing(run: PackOptions | None, columns: list[str] | None, transform: object,
                     position_ids: bool, cu_seqlens: bool) -> PackOptions | None:
    """A coordinator view's packing: the run's arguments plus the view's output options."""
    if run is not None and transform is not None:
        raise ValueError(TRANSFORM_REFUSED)
    if run is None:
        if position_ids or cu_seqlens:
            raise ValueError("pack_position_ids and pack_cu_seqlens require a packed run: "
                             "create the coordinator with pack_sequences=...")
        return None
    if columns not in (None, [run.column]):
        raise ValueError(f"this run packs column {run.column!r}; pass columns=None or "
                         f"[{run.column!r}], not {columns!r}")
    return replace(run, position_ids=bool(position_ids), cu_seqlens=bool(cu_seqlens))
