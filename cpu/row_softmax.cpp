// Softmax over the last axis of float32 scores, as an MLX primitive for a CPU.
//
// MLX's CPU softmax, and the max / exp / sum it is otherwise composed of, run one element at a
// time on x86 (its SIMD types have one lane there) with exp's polynomial through library fma
// calls.  Here each row is read once for its max and once for its exponentials and their sum,
// then scaled while it is still in cache, LANES floats at a time (GCC vector extensions, built
// for the machine it runs on: dflash_mlx/cpu_kernels.py).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

constexpr int LANES = 16;
typedef float Floats __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(LANES * sizeof(int32_t))));

inline Floats load(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Floats v) {
  std::memcpy(p, &v, sizeof v);
}

// MLX's CPU exp (mlx/backend/cpu/simd/math.h) on LANES floats: 2**(x log2 e) as a power of two
// times the same polynomial of the fraction; 0 below -88 (and for -inf)
inline Floats exp_lanes(Floats x) {
  Floats y = (x < -88.5f ? Floats{} - 88.5f : x) * 1.442695f;
  Floats half_up = y + 0.5f;
  Ints whole = __builtin_convertvector(half_up, Ints);  // toward zero: floor + 1 below zero
  whole += __builtin_convertvector(whole, Floats) > half_up;  // a true comparison is -1
  Floats fraction = y - __builtin_convertvector(whole, Floats);
  Floats p = Floats{} + 1.535336188319500e-4f;
  p = p * fraction + 1.339887440266574e-3f;
  p = p * fraction + 9.618437357674640e-3f;
  p = p * fraction + 5.550332471162809e-2f;
  p = p * fraction + 2.402264791363012e-1f;
  p = p * fraction + 6.931472028550421e-1f;
  p = p * fraction + 1.0f;
  Ints bits = (whole + 127) << 23;
  Floats two_to_whole;
  std::memcpy(&two_to_whole, &bits, sizeof two_to_whole);
  return x < -88.0f ? Floats{} : two_to_whole * p;
}

inline float exp_one(float x) {
  return exp_lanes(Floats{} + x)[0];
}

void softmax_row(const float* in, float* out, int64_t n) {
  const int64_t whole = n - n % LANES;
  Floats peaks = Floats{} - INFINITY;
  for (int64_t i = 0; i < whole; i += LANES) {
    Floats v = load(in + i);
    peaks = v > peaks ? v : peaks;
  }
  float peak = -INFINITY;
  for (int j = 0; j < LANES; ++j) peak = peaks[j] > peak ? peaks[j] : peak;
  for (int64_t i = whole; i < n; ++i) peak = in[i] > peak ? in[i] : peak;
  Floats sums = {};
  for (int64_t i = 0; i < whole; i += LANES) {
    Floats e = exp_lanes(load(in + i) - peak);
    store(out + i, e);
    sums += e;
  }
  float total = 0.0f;
  for (int j = 0; j < LANES; ++j) total += sums[j];
  for (int64_t i = whole; i < n; ++i) {
    out[i] = exp_one(in[i] - peak);
    total += out[i];
  }
  const float scale = 1.0f / total;
  for (int64_t i = 0; i < whole; i += LANES) store(out + i, load(out + i) * scale);
  for (int64_t i = whole; i < n; ++i) out[i] *= scale;
}

// Row `row`'s offset in a mask broadcast to the scores' shape (its strides: 0 where it is broadcast)
int64_t mask_offset(int64_t row, const mx::Shape& shape, const mx::Strides& strides) {
  int64_t offset = 0;
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    offset += (row % shape[d]) * strides[d];
    row /= shape[d];
  }
  return offset;
}

// The scores with a row's mask applied: a boolean one keeps, an additive one is added
inline void masked_row(const float* in, const bool* keep, int64_t step, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = keep[i * step] ? in[i] : -INFINITY;
}

inline void masked_row(const float* in, const float* add, int64_t step, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] + add[i * step];
}

class RowSoftmax : public mx::Primitive {
 public:
  explicit RowSoftmax(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& in = inputs[0];
    mx::array& out = outputs[0];
    if (in.is_donatable()) {
      out.copy_shared_buffer(in);  // in place: the scores are not needed after
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    const int64_t n = in.shape(-1), rows = n ? in.size() / n : 0;
    if (inputs.size() == 1) {
      encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), n, rows]() {
        for (int64_t r = 0; r < rows; ++r) softmax_row(src + r * n, dst + r * n, n);
      });
      return;
    }
    const mx::array& mask = inputs[1];
    encoder.set_input_array(mask);
    auto apply = [&](auto* keep) {
      encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), keep, shape = mask.shape(),
                        strides = mask.strides(), n, rows]() {
        for (int64_t r = 0; r < rows; ++r) {
          masked_row(src + r * n, keep + mask_offset(r, shape, strides), strides.back(), dst + r * n, n);
          softmax_row(dst + r * n, dst + r * n, n);
        }
      });
    };
    if (mask.dtype() == mx::bool_) {
      apply(mask.data<bool>());
    } else {
      apply(mask.data<float>());
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("row_softmax runs on a CPU stream only");
  }

  // The softmax's gradient, for the scores and for an additive mask alike (a boolean mask has none)
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override {
    const mx::array& y = outputs[0];
    const mx::array& dy = cotangents[0];
    mx::array along = mx::sum(mx::multiply(dy, y, stream()), -1, true, stream());
    mx::array grad = mx::multiply(y, mx::subtract(dy, along, stream()), stream());
    std::vector<mx::array> grads;
    for (int argnum : argnums) {
      bool boolean = argnum == 1 && primals[1].dtype() == mx::bool_;
      grads.push_back(boolean ? mx::zeros_like(primals[1], stream()) : grad);
    }
    return grads;
  }

  const char* name() const override {
    return "RowSoftmax";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

mx::array row_softmax(const mx::array& scores, const std::optional<mx::array>& mask) {
  if (scores.dtype() != mx::float32) {
    throw std::invalid_argument("row_softmax: float32 scores only");
  }
  mx::Stream stream = mx::to_stream({}, mx::Device::cpu);
  mx::array rows = mx::contiguous(scores, false, stream);
  std::vector<mx::array> inputs = {rows};
  if (mask) {
    mx::Dtype kind = mask->dtype() == mx::bool_ ? mx::bool_ : mx::float32;
    inputs.push_back(mx::broadcast_to(mx::astype(*mask, kind, stream), rows.shape(), stream));
  }
  return mx::array(rows.shape(), mx::float32, std::make_shared<RowSoftmax>(stream), std::move(inputs));
}

}  // namespace

NB_MODULE(_row_softmax, m) {
  m.def(
      "row_softmax",
      &row_softmax,
      nb::arg("scores"),
      nb::arg("mask").none() = nb::none(),
      "Softmax over the last axis of float32 scores (a CPU stream), a mask broadcast to them first "
      "applied (boolean: kept where true; else added).");
}
