// Stateless codec ops for Python: encode/decode of companded 8-bit moments with the same
// header code the kernels run, so that checkpoint conversion (torch.optim format <-> codes)
// and the kernels agree to the bit.
#include <torch/extension.h>

#include "pagedoptim/codec/companding.h"
#include "pagedoptim/common.h"

namespace pagedoptim::bindings {
namespace {

int64_t groups_for(int64_t n) { return (n + kGroupSize - 1) / kGroupSize; }

// The rows the groups of `n` values follow: `row_length` values each (0: one row of all), so
// that groups never cross a row of a parameter's last dimension (paging/page_table.h).
int64_t checked_row_length(int64_t n, int64_t row_length) {
  TORCH_CHECK_VALUE(row_length >= 0 && (row_length == 0 || n % row_length == 0),
                    "row_length must be >= 0 and divide the number of values (", n, "), got ",
                    row_length);
  return row_length == 0 || n == 0 ? std::max<int64_t>(n, 1) : row_length;
}

at::Tensor contiguous_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on cpu, got ", t.device());
  TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating tensor, got ",
                   t.scalar_type());
  return t.to(at::kFloat).contiguous().view(-1);
}

// Calls group(first value, count, group index) for every group of `n` values in rows of
// `row`: kGroupSize values each, the last of every row possibly partial.
template <class Group>
void for_each_group(int64_t n, int64_t row, const Group& group) {
  int64_t index = 0;
  for (int64_t row_begin = 0; row_begin < n; row_begin += row) {
    for (int64_t base = row_begin; base < row_begin + row; base += kGroupSize) {
      group(base, int(std::min<int64_t>(kGroupSize, row_begin + row - base)), index++);
    }
  }
}

// values [n] float -> (codes [n] int8 or uint8, scales [rows * ceil(row / 32)] float16)
template <bool kSecondMoment>
std::tuple<at::Tensor, at::Tensor> encode(const at::Tensor& input, int64_t row_length) {
  const at::Tensor values = contiguous_float(input, "values");
  const int64_t n = values.numel();
  const int64_t row = checked_row_length(n, row_length);
  at::Tensor codes = at::empty({n}, kSecondMoment ? at::kByte : at::kChar);
  at::Tensor scales = at::empty({n == 0 ? 0 : n / row * groups_for(row)}, at::kHalf);
  const float* in = values.data_ptr<float>();
  auto* scale_bits = reinterpret_cast<uint16_t*>(scales.data_ptr());
  for_each_group(n, row, [&](int64_t base, int count, int64_t group) {
    if constexpr (kSecondMoment) {
      scale_bits[group] =
          codec::encode_second_moment_group(in + base, count, codes.data_ptr<uint8_t>() + base);
    } else {
      scale_bits[group] =
          codec::encode_moment_group(in + base, count, codes.data_ptr<int8_t>() + base);
    }
  });
  return {codes.view(input.sizes()), scales};
}

template <bool kSecondMoment>
at::Tensor decode(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t row_length) {
  TORCH_CHECK_TYPE(codes_in.scalar_type() == (kSecondMoment ? at::kByte : at::kChar),
                   "codes must be ", kSecondMoment ? "uint8" : "int8", ", got ",
                   codes_in.scalar_type());
  TORCH_CHECK_TYPE(scales_in.scalar_type() == at::kHalf, "scales must be float16, got ",
                   scales_in.scalar_type());
  const at::Tensor codes = codes_in.contiguous().view(-1);
  const at::Tensor scales = scales_in.contiguous().view(-1);
  const int64_t n = codes.numel();
  const int64_t row = checked_row_length(n, row_length);
  const int64_t expected = n == 0 ? 0 : n / row * groups_for(row);
  TORCH_CHECK_VALUE(scales.numel() == expected, "scales must have one entry per group of ",
                    kGroupSize, " codes (in rows of ", row, "): expected ", expected, ", got ",
                    scales.numel());
  at::Tensor values = at::empty({n}, at::kFloat);
  const auto* scale_bits = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  for_each_group(n, row, [&](int64_t base, int count, int64_t group) {
    if constexpr (kSecondMoment) {
      codec::decode_second_moment_group(codes.data_ptr<uint8_t>() + base, scale_bits[group],
                                        count, values.data_ptr<float>() + base);
    } else {
      codec::decode_moment_group(codes.data_ptr<int8_t>() + base, scale_bits[group], count,
                                 values.data_ptr<float>() + base);
    }
  });
  return values.view(codes_in.sizes());
}

}  // namespace

void bind_codecs(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("encode_moment", &encode<false>, py::arg("values"), py::arg("row_length") = 0,
        "Companded int8 codes and fp16 group scales of first-moment values; groups of 32 "
        "restart at every row of row_length values (0: one row).");
  m.def("decode_moment", &decode<false>, py::arg("codes"), py::arg("scales"),
        py::arg("row_length") = 0);
  m.def("encode_second_moment", &encode<true>, py::arg("values"), py::arg("row_length") = 0,
        "uint8 codes of sqrt(v) and fp16 group scales of second-moment values, in rows as "
        "encode_moment.");
  m.def("decode_second_moment", &decode<true>, py::arg("codes"), py::arg("scales"),
        py::arg("row_length") = 0);
}

}  // namespace pagedoptim::bindings
