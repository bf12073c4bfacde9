"""How optimizer state is laid out in pages, and conversions between formats.

A moment named X (AdamW's exp_avg, exp_avg_sq, max_exp_avg_sq; SGD's momentum_buffer;
Lion's exp_avg) is stored either as one fp32 stream "X" (state_bits=32) or companded as
"X_codes" (int8 for first moments, uint8 codes of sqrt(v) for second moments) plus
"X_scales" (one fp16 scale per group of 32 elements of a row of the last dimension; see
`group_shape`). Params with fewer than `min_8bit_size` elements, 1-D params (norms,
biases) and complex params keep fp32 moments whatever state_bits says
(`keeps_8bit_state`). bf16/fp16 parameters with
master_bits=24|32 add a "master_residual" stream (int8 | int16). state_dict() hands these
streams out under these names; checkpoints in torch.optim's format (fp32 "X") convert to and
from the companded streams with the same codec the kernels use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from pagedoptim._native import native

GROUP_SIZE = 32
RESIDUAL = "master_residual"
# Params with fewer elements keep fp32 moments with state_bits=8, as bitsandbytes'
# min_8bit_size: they are a negligible share of a model's state (a Llama's norms and biases),
# and the 8-bit scales would cost more than they save on the smallest.
DEFAULT_MIN_8BIT_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class Moment:
    name: str
    second: bool  # a second moment (v >= 0): coded as sqrt(v), uint8


# The moments of each algorithm, by the names torch.optim gives them (SkewAdam's exact
# second moment, like its factored one, is fp32 in every format). The optimizers and the
# checkpoint conversions both read them from here.
EXP_AVG = Moment("exp_avg", second=False)
EXP_AVG_SQ = Moment("exp_avg_sq", second=True)
MAX_EXP_AVG_SQ = Moment("max_exp_avg_sq", second=True)
MOMENTUM_BUFFER = Moment("momentum_buffer", second=False)
MOMENTS: dict[str, tuple[Moment, ...]] = {
    "adamw": (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ),
    "sgd": (MOMENTUM_BUFFER,),
    "lion": (EXP_AVG,),
    "skewadam": (EXP_AVG, EXP_AVG_SQ),
}


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    name: str
    bytes_per_group: int
    per_group: bool
    dtype: torch.dtype

    def as_native(self) -> tuple[str, int, bool]:
        return (self.name, self.bytes_per_group, self.per_group)

    def tensor_from_bytes(self, raw: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The stream's raw bytes (from the engine) as a tensor of its dtype: element streams
        shaped like the parameter's state, per-group streams shaped by `group_shape`."""
        values = raw.view(self.dtype)
        return values.view(group_shape(shape) if self.per_group else shape)


def keeps_8bit_state(p: torch.Tensor, min_8bit_size: int) -> bool:
    """Whether `p` keeps 8-bit moments under state_bits=8: params of two or more dimensions
    with at least `min_8bit_size` elements (of the whole param: a DTensor's global shape, so
    every rank and one process decide alike) whose rows make 8-bit moments smaller than
    fp32 ones. 1-D params keep fp32 moments: a dim-0 shard of one (FSDP2 on 3 ranks cuts a
    4096 norm weight into 1366 elements) would cut its groups, and they are a negligible
    share of the bytes; complex params too (their real view's rows would be pairs)."""
    return shape_keeps_8bit_state(p.shape, p.is_complex(), min_8bit_size)


def shape_keeps_8bit_state(shape: torch.Size, is_complex: bool, min_8bit_size: int) -> bool:
    """keeps_8bit_state for a param of this shape (and complex or not)."""
    return (len(shape) >= 2 and math.prod(shape) >= min_8bit_size and not is_complex
            and rows_are_cheaper_in_8bit(int(shape[-1])))


def rows_are_cheaper_in_8bit(row: int) -> bool:
    """Whether a moment in rows of `row` elements takes fewer page bytes in 8 bits than in
    fp32 (4 B an element). Each row's last group takes a whole group's slot of codes (32 B)
    and a 2 B scale: a conv kernel's rows of 3 would cost 11.3 B an element, LoRA's B rows of
    8 (rank 8) 4.25 B; rows of 9 and more cost less than 4 B."""
    groups = -(-row // GROUP_SIZE)
    return row > 0 and groups * GROUP_SIZE + 2 * groups < 4 * row


def row_length(shape: torch.Size) -> int:
    """The elements of one row of the last dimension, which 8-bit groups never cross (0 for
    a param of fewer than two dimensions: one row)."""
    return int(shape[-1]) if len(shape) >= 2 else 0


def group_shape(shape: torch.Size) -> torch.Size:
    """The shape of a per-group stream (the scales) of state shaped `shape`. Groups are 32
    consecutive elements of one row of the last dimension: a row whose length is not a
    multiple of 32 ends in a partial group with its own scale, so the scales take the
    state's shape with the last dimension d replaced by ceil(d / 32). A shard of the param
    along any dimension but the last (FSDP2's Shard(0)) then holds whole groups and is the
    same shard of its scales, whatever the shapes and the world size
    (pagedoptim/state/sharding.py); one along the last dimension does where it is cut at a
    multiple of 32. A param of fewer than two dimensions is one row."""
    if len(shape) >= 2:
        return torch.Size([*shape[:-1], -(-int(shape[-1]) // GROUP_SIZE)])
    return torch.Size([-(-math.prod(shape) // GROUP_SIZE)])


def flat_group_shape(shape: torch.Size) -> torch.Size:
    """The scales' shape in the layout of pagedoptim before 0.2: groups of 32 in flat element
    order, crossing rows whose length is not a multiple of 32 (where it is, both layouts
    are the same and the scales had `group_shape` already)."""
    return torch.Size([-(-math.prod(shape) // GROUP_SIZE)])


def is_flat_layout(scales: torch.Tensor, shape: torch.Size) -> bool:
    """Whether `scales` of state shaped `shape` were saved in the flat layout of old
    checkpoints where its groups differ from today's: a 1-D tensor of one scale per 32
    elements in flat order, for a param of several rows whose length is not a multiple of
    32. (Today's scales of such a param have its number of dimensions; flattened, they are
    told apart by their count where it differs.)"""
    rows_differ = (len(shape) >= 2 and int(shape[-1]) % GROUP_SIZE != 0
                   and math.prod(shape[:-1]) > 1)
    return (rows_differ and scales.dim() == 1
            and scales.numel() == math.prod(flat_group_shape(shape)))


def moment_streams(moment: Moment, state_bits: int) -> list[StreamSpec]:
    if state_bits == 32:
        return [StreamSpec(moment.name, 4 * GROUP_SIZE, False, torch.float32)]
    codes = torch.uint8 if moment.second else torch.int8
    return [StreamSpec(f"{moment.name}_codes", GROUP_SIZE, False, codes),
            StreamSpec(f"{moment.name}_scales", 2, True, torch.float16)]


def full_precision(kind: list[StreamSpec]) -> list[StreamSpec]:
    """The streams of `kind` with its 8-bit moments as fp32 ones (the kind of a param that
    keeps fp32 moments under state_bits=8: `keeps_8bit_state`)."""
    streams = []
    for spec in kind:
        if spec.name.endswith("_codes"):
            streams.append(StreamSpec(spec.name[:-len("_codes")], 4 * GROUP_SIZE, False,
                                      torch.float32))
        elif not spec.per_group:
            streams.append(spec)
    return streams


def is_group_stream(name: str) -> bool:
    """Whether the stream (or state_dict key) `name` holds one value per group of 32."""
    return name.endswith("_scales")


def residual_stream(master_bits: int) -> StreamSpec:
    if master_bits == 24:
        return StreamSpec(RESIDUAL, GROUP_SIZE, False, torch.int8)
    return StreamSpec(RESIDUAL, 2 * GROUP_SIZE, False, torch.int16)


def all_stream_names(moments: list[Moment]) -> set[str]:
    """Every state_dict key a page stream of these moments can have, in any format."""
    names = {RESIDUAL}
    for moment in moments:
        names |= {moment.name, f"{moment.name}_codes", f"{moment.name}_scales"}
    return names


def _moment_of(stream: str, moments: list[Moment]) -> Optional[Moment]:
    for moment in moments:
        if stream in (moment.name, f"{moment.name}_codes", f"{moment.name}_scales"):
            return moment
    return None


def encode(moment: Moment, values: torch.Tensor, shape: torch.Size
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales (shaped `group_shape(shape)`) of fp32 `values` of state shaped `shape`,
    with the kernels' codec."""
    encode_groups = native.encode_second_moment if moment.second else native.encode_moment
    _check_elements(moment.name, values, shape)
    flat = values.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    codes, scales = encode_groups(flat, row_length(shape))
    return codes.view(shape), scales.view(group_shape(shape))


def decode(moment: Moment, codes: torch.Tensor, scales: torch.Tensor, shape: torch.Size
           ) -> torch.Tensor:
    """The fp32 values (shaped `shape`) of codes and scales, in today's layout or in the flat
    one of old checkpoints (`is_flat_layout`)."""
    decode_groups = native.decode_second_moment if moment.second else native.decode_moment
    _check_elements(f"{moment.name}_codes", codes, shape)
    rows = 0 if is_flat_layout(scales, shape) else row_length(shape)
    values = decode_groups(codes.detach().to("cpu").reshape(-1),
                           scales.detach().to(device="cpu", dtype=torch.float16).reshape(-1),
                           rows)
    return values.view(shape)


def _check_elements(name: str, value: torch.Tensor, shape: torch.Size) -> None:
    if value.numel() != math.prod(shape):
        raise ValueError(f"'{name}' has {value.numel()} elements, expected {math.prod(shape)} "
                         f"(the param's state is {tuple(shape)})")


def convert_for_stream(spec: StreamSpec, moments: list[Moment],
                       given: dict[str, torch.Tensor], shape: torch.Size
                       ) -> Optional[torch.Tensor]:
    """The value of stream `spec` for one parameter whose state is shaped `shape`, from
    whatever format `given` holds: the stream itself, the fp32 moment (quantized here), or
    codes + scales (dequantized). Codes + scales in the flat layout of old checkpoints
    (`is_flat_layout`: told apart by the scales' shape) are decoded and encoded again in
    rows (docs/compression.md, "Checkpoints from before row groups"). None when `given` has
    nothing for it."""
    moment = _moment_of(spec.name, moments)
    if moment is None:  # the master residual
        return given.get(spec.name)
    codes_name, scales_name = f"{moment.name}_codes", f"{moment.name}_scales"
    codes, scales = given.get(codes_name), given.get(scales_name)
    regroup = codes is not None and scales is not None and is_flat_layout(scales, shape)
    if spec.name in given and not regroup:
        return given[spec.name]
    if spec.name == moment.name:  # fp32 wanted: decode the codes
        if codes is None or scales is None:
            return None
        return decode(moment, codes, scales, shape)
    # Codes or scales wanted: encode the fp32 moment, or the old layout's codes decoded.
    fp32 = decode(moment, codes, scales, shape) if regroup else given.get(moment.name)
    if fp32 is None:
        return None
    codes, scales = encode(moment, fp32, shape)
    return codes if spec.name == codes_name else scales


def expected_numel(spec: StreamSpec, shape: torch.Size) -> int:
    return math.prod(group_shape(shape)) if spec.per_group else math.prod(shape)


def report_field(spec: StreamSpec) -> str:
    """The memory_report() field a stream's bytes count in."""
    if spec.name == RESIDUAL:
        return "residual_bytes"
    return "scale_bytes" if spec.per_group else "moment_bytes"
