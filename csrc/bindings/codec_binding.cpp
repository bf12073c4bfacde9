// Stateless codec ops for Python: encode/decode of companded 8-bit moments with the same
// header code the kernels run, so that checkpoint conversion (torch.optim format <-> codes)
// and the kernels agree to the bit.
#include <torch/extension.h>

#include "pagedoptim/codec/companding.h"
#include "pagedoptim/common.h"

namespace pagedoptim::bindings {
namespace {

int64_t num_groups(int64_t n) { return (n + kGroupSize - 1) / kGroupSize; }

at::Tensor contiguous_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on cpu, got ", t.device());
  TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating tensor, got ",
                   t.scalar_type());
  return t.to(at::kFloat).contiguous().view(-1);
}

// values [n] float -> (codes [n] int8 or uint8, scales [ceil(n/32)] float16)
template <bool kSecondMoment>
std::tuple<at::Tensor, at::Tensor> encode(const at::Tensor& input) {
  const at::Tensor values = contiguous_float(input, "values");
  const int64_t n = values.numel();
  at::Tensor codes = at::empty({n}, kSecondMoment ? at::kByte : at::kChar);
  at::Tensor scales = at::empty({num_groups(n)}, at::kHalf);
  const float* in = values.data_ptr<float>();
  auto* scale_bits = reinterpret_cast<uint16_t*>(scales.data_ptr());
  for (int64_t base = 0; base < n; base += kGroupSize) {
    const int count = int(std::min<int64_t>(kGroupSize, n - base));
    if constexpr (kSecondMoment) {
      scale_bits[base / kGroupSize] =
          codec::encode_second_moment_group(in + base, count, codes.data_ptr<uint8_t>() + base);
    } else {
      scale_bits[base / kGroupSize] =
          codec::encode_moment_group(in + base, count, codes.data_ptr<int8_t>() + base);
    }
  }
  return {codes.view(input.sizes()), scales};
}

template <bool kSecondMoment>
at::Tensor decode(const at::Tensor& codes_in, const at::Tensor& scales_in) {
  TORCH_CHECK_TYPE(codes_in.scalar_type() == (kSecondMoment ? at::kByte : at::kChar),
                   "codes must be ", kSecondMoment ? "uint8" : "int8", ", got ",
                   codes_in.scalar_type());
  TORCH_CHECK_TYPE(scales_in.scalar_type() == at::kHalf, "scales must be float16, got ",
                   scales_in.scalar_type());
  const at::Tensor codes = codes_in.contiguous().view(-1);
  const at::Tensor scales = scales_in.contiguous().view(-1);
  const int64_t n = codes.numel();
  TORCH_CHECK_VALUE(scales.numel() == num_groups(n), "scales must have one entry per group of ",
                    kGroupSize, " codes: expected ", num_groups(n), ", got ", scales.numel());
  at::Tensor values = at::empty({n}, at::kFloat);
  const auto* scale_bits = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  for (int64_t base = 0; base < n; base += kGroupSize) {
    const int count = int(std::min<int64_t>(kGroupSize, n - base));
    if constexpr (kSecondMoment) {
      codec::decode_second_moment_group(codes.data_ptr<uint8_t>() + base,
                                        scale_bits[base / kGroupSize], count,
                                        values.data_ptr<float>() + base);
    } else {
      codec::decode_moment_group(codes.data_ptr<int8_t>() + base, scale_bits[base / kGroupSize],
                                 count, values.data_ptr<float>() + base);
    }
  }
  return values.view(codes_in.sizes());
}

}  // namespace

void bind_codecs(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("encode_moment", &encode<false>, py::arg("values"),
        "Companded int8 codes and fp16 group scales of first-moment values.");
  m.def("decode_moment", &decode<false>, py::arg("codes"), py::arg("scales"));
  m.def("encode_second_moment", &encode<true>, py::arg("values"),
        "uint8 codes of sqrt(v) and fp16 group scales of second-moment values.");
  m.def("decode_second_moment", &decode<true>, py::arg("codes"), py::arg("scales"));
}

}  // namespace pagedoptim::bindings
