"""How optimizer state is laid out in pages, and conversions between formats.

A moment named X (AdamW's exp_avg, exp_avg_sq, max_exp_avg_sq; SGD's momentum_buffer;
Lion's exp_avg) is stored either as one fp32 stream "X" (state_bits=32) or companded as
"X_codes" (int8 for first moments, uint8 codes of sqrt(v) for second moments) plus
"X_scales" (one fp16 scale per group of 32 elements). bf16/fp16 parameters with
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


def group_shape(shape: torch.Size) -> torch.Size:
    """The shape of a per-group stream (the scales) of state shaped `shape`. Groups are 32
    consecutive elements in flat order; where the last dimension is a multiple of 32 they
    never cross one of its rows, and the scales take the state's shape with that dimension
    divided by 32, so a shard of the param along any dimension that keeps whole groups is
    the same shard of its scales (pagedoptim/state/sharding.py). Else they are flat."""
    if len(shape) >= 2 and shape[-1] % GROUP_SIZE == 0:
        return torch.Size([*shape[:-1], shape[-1] // GROUP_SIZE])
    return torch.Size([(math.prod(shape) + GROUP_SIZE - 1) // GROUP_SIZE])


def moment_streams(moment: Moment, state_bits: int) -> list[StreamSpec]:
    if state_bits == 32:
        return [StreamSpec(moment.name, 4 * GROUP_SIZE, False, torch.float32)]
    codes = torch.uint8 if moment.second else torch.int8
    return [StreamSpec(f"{moment.name}_codes", GROUP_SIZE, False, codes),
            StreamSpec(f"{moment.name}_scales", 2, True, torch.float16)]


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


def convert_for_stream(spec: StreamSpec, moments: list[Moment],
                       given: dict[str, torch.Tensor], numel: int) -> Optional[torch.Tensor]:
    """The value of stream `spec` for one parameter, from whatever format `given` holds:
    the stream itself, the fp32 moment (quantized here), or codes + scales (dequantized).
    None when `given` has nothing for it."""
    if spec.name in given:
        return given[spec.name]
    if spec.name == RESIDUAL:
        return None
    moment = _moment_of(spec.name, moments)
    if moment is None:
        return None
    encode = native.encode_second_moment if moment.second else native.encode_moment
    decode = native.decode_second_moment if moment.second else native.decode_moment
    if spec.name == moment.name:  # fp32 wanted, codes given
        codes, scales = given.get(f"{moment.name}_codes"), given.get(f"{moment.name}_scales")
        if codes is None or scales is None:
            return None
        return decode(codes.reshape(-1), scales.reshape(-1).to(torch.float16))
    fp32 = given.get(moment.name)
    if fp32 is None:
        return None
    codes, scales = encode(fp32.detach().to(device="cpu", dtype=torch.float32).reshape(-1))
    return codes if spec.name.endswith("_codes") else scales


def expected_numel(spec: StreamSpec, numel: int) -> int:
    return (numel + GROUP_SIZE - 1) // GROUP_SIZE if spec.per_group else numel


def report_field(spec: StreamSpec) -> str:
    """The memory_report() field a stream's bytes count in."""
    if spec.name == RESIDUAL:
        return "residual_bytes"
    return "scale_bytes" if spec.per_group else "moment_bytes"
