// Max pooling (1-d, 2-d, 3-d) in the compiled core: output and window positions in one parallel pass.
//
// Stock's CPU max pooling writes the output and int64 flat indices and keeps the input plus those indices for
// backward; slimgrad's Python Function keeps one small integer per output instead (the winner's position inside
// its window, dtype functional.pooling.position_dtype(prod(kernel))). Here one parallel pass writes the output and
// those positions; backward zeroes each plane
// of the input gradient and adds every output's gradient at its winner in row-major output order, per plane
// (channels_last: per sample and channel block), the order stock's backward kernel adds them, so overlapping
// windows give stock's sums bit for bit.
//
// Stock's rules, followed step for step (aten/src/ATen/native/cpu/MaxPoolKernel.cpp): the window is scanned
// in row-major order over its in-bounds positions, starting from -inf with the first in-bounds position as the
// winner, taking an element when `value > max || isnan(value)` (first maximum wins ties, the last NaN wins);
// bf16/fp16 compare in fp32 and round once. The layout is the input's suggested memory format (channels_last
// inputs give channels_last outputs and gradients); 1-d pooling is 2-d pooling of x.unsqueeze(-2), as in aten.
// Stock's channels_last bf16 kernel converts its fp32 maxima to bf16 with a vector conversion for the first
// C - C % (vector width) channels (a NaN becomes 0xffff there) and the scalar one for the rest (0x7fc0); the
// output's NaN bits follow the same split. Calls this file does not serve (invalid arguments, whose errors
// stock's kernels word, empty inputs, 3-d pooling of an unbatched non-contiguous input, return_indices) return
// None and the Python Function runs.
#include "common.h"

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/Version.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kGrain = 32768;  // aten's GRAIN_SIZE, in window elements visited

// Pooling options, normalised to (D, H, W) (2-d: D = 1; 1-d: D = H = 1) with stride defaulted to kernel.
struct PoolOptions {
  int64_t nd = 2;
  int64_t k[3] = {1, 1, 1}, s[3] = {1, 1, 1}, p[3] = {0, 0, 0}, d[3] = {1, 1, 1};
  bool ceil_mode = false;
  bool valid = false;  // the checks stock makes on options alone hold, no indices returned (else every call goes
                       // to Python)
  int64_t kvol = 1;
  at::ScalarType pos_dtype = at::kByte;
};

at::ScalarType position_dtype(int64_t volume) {
  if (volume <= 256) return at::kByte;
  if (volume <= (int64_t(1) << 15)) return at::kShort;
  if (volume <= (int64_t(1) << 31)) return at::kInt;
  return at::kLong;
}

PoolOptions make_options(int64_t nd, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                         std::vector<int64_t> padding, std::vector<int64_t> dilation, bool ceil_mode,
                         bool return_indices) {
  PoolOptions o;
  o.nd = nd;
  o.ceil_mode = ceil_mode;
  if (nd < 1 || nd > 3 || (int64_t)kernel.size() != nd || (int64_t)stride.size() != nd ||
      (int64_t)padding.size() != nd || (int64_t)dilation.size() != nd)
    return o;
  bool ok = true;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t j = 3 - nd + i;
    o.k[j] = kernel[i];
    o.s[j] = stride[i];
    o.p[j] = padding[i];
    o.d[j] = dilation[i];
    ok = ok && kernel[i] > 0 && stride[i] > 0 && dilation[i] > 0 && padding[i] >= 0 && padding[i] <= kernel[i] / 2;
  }
  o.kvol = o.k[0] * o.k[1] * o.k[2];
  o.pos_dtype = position_dtype(o.kvol);
  // Positions ride in fp32 lanes (exact below 2^24): larger windows go to the Python Function. So do calls that
  // return the indices: those exist anyway, and the Python Function keeps them in place of positions (stock keeps
  // them and the input); positions beside them put the peak above stock's by their bytes (2-d fp32 4x8x12x12:
  // 33416 B against 32264).
  o.valid = ok && o.kvol <= (int64_t(1) << 24) && !return_indices;
  return o;
}

// aten's pooling_output_shape.
int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d, bool ceil_mode) {
  int64_t num = in + 2 * p - d * (k - 1) - 1 + (ceil_mode ? s - 1 : 0);
  int64_t q = num / s;
  if ((num % s != 0) && ((num < 0) != (s < 0))) --q;  // floor division
  int64_t out = q + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;
  return out;
}

// Whether some output's window has no in-bounds element along a dim (its recorded winner then lies outside
// the input: stock writes there in backward; here such gradients are dropped).
bool has_empty_window(int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, int64_t d) {
  for (int64_t o = 0; o < out; ++o) {
    int64_t start = o * s - p;
    bool any = false;
    for (int64_t j = 0; j < k && !any; ++j) {
      int64_t i = start + j * d;
      any = i >= 0 && i < in;
    }
    if (!any) return true;
  }
  return false;
}

struct Geometry {
  int64_t N = 1, C = 1, D = 1, H = 1, W = 1, OD = 1, OH = 1, OW = 1;
  bool channels_last = false;
  bool checked = false;  // some window may be empty: bounds-check the backward scatter
  std::vector<int64_t> x_sizes, out_sizes, x_strides, out_strides;
};

// Strides of `sizes` (the internal 4-d/5-d or unbatched shape) in the given format; for 1-d, dim -2 (of size
// one, inserted by the caller) is dropped afterwards, as aten's squeeze(-2) does.
std::vector<int64_t> strides_for(const std::vector<int64_t>& sizes, bool channels_last) {
  const int64_t n = sizes.size();
  std::vector<int64_t> st(n);
  if (!channels_last) {
    int64_t s = 1;
    for (int64_t i = n - 1; i >= 0; --i) {
      st[i] = s;
      s *= std::max<int64_t>(sizes[i], 1);
    }
    return st;
  }
  // c10::get_channels_last_strides_2d/3d: C fastest, then the spatial dims, then N.
  st[1] = 1;
  int64_t s = sizes[1];
  for (int64_t i = n - 1; i >= 2; --i) {
    st[i] = s;
    s *= sizes[i];
  }
  st[0] = s;
  return st;
}

// The geometry of one call, or nothing when this file does not serve it. `x4` gets the input laid out as the
// kernels read it (contiguous in the chosen format, 1-d as 2-d).
std::optional<Geometry> prepare(const at::Tensor& x, const PoolOptions& o, at::Tensor& x4, bool force_contiguous) {
  if (!o.valid) return std::nullopt;
  const int64_t nd = o.nd, dim = x.dim();
  if (dim != nd + 1 && dim != nd + 2) return std::nullopt;
  const auto st = x.scalar_type();
  if (st != at::kFloat && st != at::kDouble && st != at::kBFloat16 && st != at::kHalf) return std::nullopt;
  if (x.numel() == 0) return std::nullopt;
  Geometry g;
  const bool batched = dim == nd + 2;
  g.N = batched ? x.size(0) : 1;
  g.C = x.size(batched ? 1 : 0);
  const int64_t s0 = dim - nd;
  int64_t sp[3] = {1, 1, 1};
  for (int64_t i = 0; i < nd; ++i) sp[3 - nd + i] = x.size(s0 + i);
  g.D = sp[0];
  g.H = sp[1];
  g.W = sp[2];
  g.OD = out_size(g.D, o.k[0], o.s[0], o.p[0], o.d[0], o.ceil_mode);
  g.OH = out_size(g.H, o.k[1], o.s[1], o.p[1], o.d[1], o.ceil_mode);
  g.OW = out_size(g.W, o.k[2], o.s[2], o.p[2], o.d[2], o.ceil_mode);
  if (g.OD < 1 || g.OH < 1 || g.OW < 1) return std::nullopt;
  // The internal tensor aten's kernel sees: 1-d runs as 2-d on x.unsqueeze(-2).
  at::Tensor xi = nd == 1 ? x.unsqueeze(-2) : x;
  at::MemoryFormat fmt = at::MemoryFormat::Contiguous;
  if (!force_contiguous) {
    if (xi.dim() == 4 && nd <= 2) {
      if (xi.suggest_memory_format() == at::MemoryFormat::ChannelsLast) fmt = at::MemoryFormat::ChannelsLast;
    } else if (xi.dim() == 5) {
      if (xi.suggest_memory_format() == at::MemoryFormat::ChannelsLast3d) fmt = at::MemoryFormat::ChannelsLast3d;
    } else if (nd == 3 && !x.is_contiguous()) {
      return std::nullopt;  // aten's unbatched 3-d layout workaround: the Python Function
    }
  } else if (!x.is_contiguous()) {
    return std::nullopt;
  }
  g.channels_last = fmt != at::MemoryFormat::Contiguous;
  if (g.channels_last && nd == 3 && (o.kvol == 256 || o.kvol == (int64_t(1) << 15))) return std::nullopt;
  x4 = xi.is_contiguous(fmt) ? xi : xi.contiguous(fmt);
  g.checked = has_empty_window(g.D, g.OD, o.k[0], o.s[0], o.p[0], o.d[0]) ||
              has_empty_window(g.H, g.OH, o.k[1], o.s[1], o.p[1], o.d[1]) ||
              has_empty_window(g.W, g.OW, o.k[2], o.s[2], o.p[2], o.d[2]);
  // Sizes and strides of x's and the output's final shapes.
  std::vector<int64_t> isz = xi.sizes().vec();
  std::vector<int64_t> osz = isz;
  const int64_t r = osz.size();
  if (nd == 3) osz[r - 3] = g.OD;
  osz[r - 2] = nd == 1 ? 1 : g.OH;
  osz[r - 1] = g.OW;
  std::vector<int64_t> xst = strides_for(isz, g.channels_last), ost = strides_for(osz, g.channels_last);
  if (nd == 1) {
    for (auto* v : {&isz, &osz, &xst, &ost}) v->erase(v->end() - 2);
  }
  g.x_sizes = std::move(isz);
  g.out_sizes = std::move(osz);
  g.x_strides = std::move(xst);
  g.out_strides = std::move(ost);
  return g;
}

// ------------------------------------------------------------------------------------------ conversions

// Stock's channels_last bf16 kernel: vector conversion (NaN -> 0xffff) for the first `vec_len` channels.
template <typename scalar_t, typename acc_t>
inline scalar_t round_out(acc_t v, bool vector_lane) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (vector_lane && std::isnan(v)) return c10::BFloat16(0xffff, c10::BFloat16::from_bits());
  }
  return static_cast<scalar_t>(v);
}

// Whether stock's reduced-float conversions are vector instructions here. Its max-pool kernels are registered
// with plain REGISTER_DISPATCH, which gives AVX512 CPUs the AVX2 variant: 32-byte vectors on every x86 CPU with
// AVX2 (measured: the channel split below moves with 32-byte vectors on an AVX512 machine). Without AVX2
// (DEFAULT) the generic Vectorized is 32 bytes too, converting element by element.
bool vector_conversions() {
  static const bool v = [] {
#if defined(__x86_64__) || defined(_M_X64)
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX512" || cap == "AVX2";
#else
    return false;
#endif
  }();
  return v;
}

constexpr int64_t kStockVectorBytes = 32;

// ------------------------------------------------------------------------------------------ forward

// Window extent along one dim for output index o: first in-bounds input index (stock's adjusted start), its
// window offset, and the end (exclusive).
struct Span {
  int64_t start, k0, end, origin;
};

inline Span span(int64_t o, int64_t s, int64_t p, int64_t k, int64_t d, int64_t in) {
  Span r;
  r.origin = o * s - p;
  r.end = std::min(r.origin + (k - 1) * d + 1, in);
  r.start = r.origin;
  r.k0 = 0;
  while (r.start < 0) {
    r.start += d;
    ++r.k0;
  }
  return r;
}

// best/bpos[j] take src[j] and position pv where src[j] > best[j] or src[j] is NaN (stock's test), j < n.
template <typename acc_t>
inline void max_update(const acc_t* src, acc_t* bb, acc_t* bq, int64_t n, acc_t pv) {
  using Vec = at::vec::Vectorized<acc_t>;
  const Vec vp(pv);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec v = Vec::loadu(src + j), b = Vec::loadu(bb + j), q = Vec::loadu(bq + j);
    const Vec m = (v > b) | v.isnan();
    Vec::blendv(b, v, m).store(bb + j);
    Vec::blendv(q, vp, m).store(bq + j);
  }
  for (; j < n; ++j) {
    const acc_t v = src[j];
    const bool take = (v > bb[j]) | (v != v);
    bb[j] = take ? v : bb[j];
    bq[j] = take ? pv : bq[j];
  }
}

// 16 channels as fp32 (fp64) vectors: loaded as they are, or converted exactly from bf16/fp16.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
inline void load16(const scalar_t* p, at::vec::Vectorized<acc_t>* v) {
  using Vec = at::vec::Vectorized<acc_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    for (int i = 0; i < 16 / Vec::size(); ++i) v[i] = Vec::loadu(p + i * Vec::size());
  } else {
    static_assert(at::vec::Vectorized<scalar_t>::size() == 16 && Vec::size() == 8, "16 reduced floats a vector");
    auto halves = at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(p));
    v[0] = std::get<0>(halves);
    v[1] = std::get<1>(halves);
  }
}

// Window positions of 16 channels (fp32 lanes, exact integers) to pos_t: converted and packed in vector
// registers (the scalar conversion, one per channel, was a sixth of the channels_last forward's time at 64
// channels).
template <typename pos_t, typename Vec>
inline void store_positions(const Vec* bpos, int nvec, pos_t* dst) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<typename Vec::value_type, float> && Vec::size() == 8) {
    for (int v = 0; v < nvec; ++v) {
      const __m256i iv = _mm256_cvttps_epi32(static_cast<__m256>(bpos[v]));
      if constexpr (sizeof(pos_t) == 4) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * v), iv);
      } else {
        // values in [0, 2^15]: unsigned saturation keeps them (32768 becomes int16 -32768, as the scalar cast)
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(iv), _mm256_extracti128_si256(iv, 1));
        if constexpr (sizeof(pos_t) == 2)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * v), w16);
        else
          _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + 8 * v), _mm_packus_epi16(w16, w16));
      }
    }
    return;
  }
#endif
  using acc_t = typename Vec::value_type;
  acc_t tmp[16];
  for (int v = 0; v < nvec; ++v) bpos[v].store(tmp + v * Vec::size());
  for (int j = 0; j < nvec * Vec::size(); ++j) dst[j] = static_cast<pos_t>(tmp[j]);
}

// One output row at a time, vectorised over the row's outputs: for each window position (row-major, the
// order stock scans), the row's inputs at that position (a strided slice) are compared with the running maxima
// of all the outputs whose window has it in bounds. Each output sees stock's comparisons in stock's order, so
// the winners are stock's; fp32 lanes carry the positions (exact up to 2^24, make_options' limit).
template <typename scalar_t, typename pos_t>
void forward_contiguous(const scalar_t* x, scalar_t* out, pos_t* pos, const Geometry& g, const PoolOptions& o) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t in_plane = g.D * g.H * g.W, out_plane = g.OD * g.OH * g.OW;
  const int64_t rows = g.N * g.C * g.OD * g.OH;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, g.OW * o.kvol));
  const int64_t kD = o.k[0], kH = o.k[1], kW = o.k[2], dD = o.d[0], dH = o.d[1], dW = o.d[2];
  const int64_t sW = o.s[2], pW = o.p[2], OW = g.OW, W = g.W;
  // For each kw: the outputs [lo, hi) whose input column ow * sW - pW + kw * dW is inside the input.
  std::vector<int64_t> lo(kW), hi(kW), kw0(OW);
  for (int64_t kw = 0; kw < kW; ++kw) {
    const int64_t off = kw * dW - pW;
    lo[kw] = off >= 0 ? 0 : (-off + sW - 1) / sW;
    hi[kw] = W - 1 - off < 0 ? 0 : std::min<int64_t>(OW, (W - 1 - off) / sW + 1);
    hi[kw] = std::max(hi[kw], lo[kw]);
  }
  for (int64_t ow = 0; ow < OW; ++ow) kw0[ow] = span(ow, sW, pW, kW, dW, W).k0;
  constexpr bool direct = std::is_same_v<scalar_t, acc_t>;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(3 * OW);
    acc_t* best = buf.data();
    acc_t* bpos = best + OW;
    acc_t* tmp = bpos + OW;
    const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
    for (int64_t r = begin; r < end; ++r) {
      const int64_t oh = r % g.OH, od = (r / g.OH) % g.OD, c = r / (g.OH * g.OD);
      const scalar_t* xp = x + c * in_plane;
      const int64_t o0 = c * out_plane + (od * g.OH + oh) * g.OW;
      const Span sd = span(od, o.s[0], o.p[0], kD, dD, g.D);
      const Span sh = span(oh, o.s[1], o.p[1], kH, dH, g.H);
      const int64_t base_p = (sd.k0 * kH + sh.k0) * kW;
      for (int64_t ow = 0; ow < OW; ++ow) {
        best[ow] = ninf;
        bpos[ow] = static_cast<acc_t>(base_p + kw0[ow]);
      }
      int64_t kd = sd.k0;
      for (int64_t id = sd.start; id < sd.end; id += dD, ++kd) {
        int64_t kh = sh.k0;
        for (int64_t ih = sh.start; ih < sh.end; ih += dH, ++kh) {
          const scalar_t* row = xp + (id * g.H + ih) * W;
          const int64_t pbase = (kd * kH + kh) * kW;
          for (int64_t kw = 0; kw < kW; ++kw) {
            const int64_t l = lo[kw], n = hi[kw] - l;
            if (n <= 0) continue;
            const scalar_t* first = row + l * sW + kw * dW - pW;
            const acc_t* src;
            if (direct && sW == 1) {
              src = reinterpret_cast<const acc_t*>(first);
            } else {
              for (int64_t j = 0; j < n; ++j) tmp[j] = static_cast<acc_t>(first[j * sW]);
              src = tmp;
            }
            max_update<acc_t>(src, best + l, bpos + l, n, static_cast<acc_t>(pbase + kw));
          }
        }
      }
      for (int64_t ow = 0; ow < OW; ++ow) {
        out[o0 + ow] = static_cast<scalar_t>(best[ow]);
        pos[o0 + ow] = static_cast<pos_t>(bpos[ow]);
      }
    }
  });
}

template <typename scalar_t, typename pos_t>
void forward_channels_last(const scalar_t* x, scalar_t* out, pos_t* pos, const Geometry& g, const PoolOptions& o) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = g.C;
  const int64_t pixels = g.N * g.OD * g.OH * g.OW;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, C * o.kvol));
  const int64_t kD = o.k[0], kH = o.k[1], kW = o.k[2], dD = o.d[0], dH = o.d[1], dW = o.d[2];
  // Stock vectorises over channels: the first `vec_len` channels, then one at a time. Its bf16 maxima convert
  // with a vector instruction there (NaN -> 0xffff), and its 3-d scalar channels start from the index of the
  // window's first in-bounds (h, w) without the depth term: an all -inf window then reports that element of
  // depth 0, kept here as position `kvol` (prepare routes windows whose position dtype has no room for it).
  const int64_t lanes = kStockVectorBytes / static_cast<int64_t>(sizeof(scalar_t));
  const int64_t vec_len = C - C % lanes;
  const int64_t nan_len = std::is_same_v<scalar_t, c10::BFloat16> && vector_conversions() ? vec_len : 0;
  const bool depthless_tail = o.nd == 3;
  const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int kVecs = 16 / Vec::size();
  const int64_t C16 = C - C % 16;
  std::vector<Span> dspans(g.OD), hspans(g.OH), wspans(g.OW);
  for (int64_t i = 0; i < g.OD; ++i) dspans[i] = span(i, o.s[0], o.p[0], kD, dD, g.D);
  for (int64_t i = 0; i < g.OH; ++i) hspans[i] = span(i, o.s[1], o.p[1], kH, dH, g.H);
  for (int64_t i = 0; i < g.OW; ++i) wspans[i] = span(i, o.s[2], o.p[2], kW, dW, g.W);
  // fp32/fp64 blocks go straight to the output unless the arrays are read afterwards (3-d's rule).
  const bool direct = std::is_same_v<scalar_t, acc_t> && !depthless_tail;
  // Windows up to this size are listed once per pixel (larger ones are walked per channel block).
  const bool use_list = o.kvol <= 1024;
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(scalar_t));
#if defined(__AVX2__)
  const bool prefetch = use_list && C * static_cast<int64_t>(sizeof(scalar_t)) >= 256;
#else
  const bool prefetch = false;
#endif
  const int64_t next = o.s[2] * C;
  at::parallel_for(0, pixels, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> buf(3 * C);
    std::vector<int64_t> woff(use_list ? o.kvol : 0);
    std::vector<acc_t> wpos(use_list ? o.kvol : 0);
    acc_t* bm = buf.data();
    acc_t* bp = bm + C;
    acc_t* tmp = bp + C;
    // The pixel's coordinates, stepped (divisions only once per chunk).
    int64_t ow = begin % g.OW, oh = (begin / g.OW) % g.OH, od = (begin / (g.OW * g.OH)) % g.OD,
            n = begin / (g.OW * g.OH * g.OD);
    for (int64_t i = begin; i < end; ++i) {
      if (i != begin && ++ow == g.OW) {
        ow = 0;
        if (++oh == g.OH) {
          oh = 0;
          if (++od == g.OD) {
            od = 0;
            ++n;
          }
        }
      }
      const Span& sd = dspans[od];
      const Span& sh = hspans[oh];
      const Span& sw = wspans[ow];
      const acc_t p0 = static_cast<acc_t>((sd.k0 * kH + sh.k0) * kW + sw.k0);
      scalar_t* op = out + i * C;
      pos_t* pp = pos + i * C;
      // The window's in-bounds elements (offset, position), listed once per pixel for every channel block.
      int64_t listed = 0;
      if (use_list) {
        int64_t kd = sd.k0;
        for (int64_t id = sd.start; id < sd.end; id += dD, ++kd) {
          int64_t kh = sh.k0;
          for (int64_t ih = sh.start; ih < sh.end; ih += dH, ++kh) {
            int64_t kw = sw.k0;
            for (int64_t iw = sw.start; iw < sw.end; iw += dW, ++kw, ++listed) {
              woff[listed] = (((n * g.D + id) * g.H + ih) * g.W + iw) * C;
              wpos[listed] = static_cast<acc_t>((kd * kH + kh) * kW + kw);
            }
          }
        }
      }
      // Every in-bounds window element in stock's (row-major) order: f(its channel vector, its position).
      auto each = [&](auto&& f) {
        if (use_list) {
          for (int64_t j = 0; j < listed; ++j) f(x + woff[j], wpos[j]);
          return;
        }
        int64_t kd = sd.k0;
        for (int64_t id = sd.start; id < sd.end; id += dD, ++kd) {
          int64_t kh = sh.k0;
          for (int64_t ih = sh.start; ih < sh.end; ih += dH, ++kh) {
            int64_t kw = sw.k0;
            for (int64_t iw = sw.start; iw < sw.end; iw += dW, ++kw)
              f(x + (((n * g.D + id) * g.H + ih) * g.W + iw) * C, static_cast<acc_t>((kd * kH + kh) * kW + kw));
          }
        }
      };
      // Blocks of 16 channels: maxima and positions stay in registers over the whole window (blocks of 32 were
      // slower: measured 2.5-2.8 against 2.1-2.3 ms at 8x64x112^2).
      auto block = [&](int64_t c0, auto width) {
        constexpr int kWidth = decltype(width)::value, kV = kWidth / Vec::size();
        Vec best[kV], bpos[kV];
        for (int v = 0; v < kV; ++v) {
          best[v] = Vec(ninf);
          bpos[v] = Vec(p0);
        }
        each([&](const scalar_t* in, acc_t pv) {
          const Vec vp(pv);
          for (int h = 0; h < kWidth / 16; ++h) {
            Vec val[kVecs];
            load16<scalar_t>(in + c0 + 16 * h, val);
            for (int v = 0; v < kVecs; ++v) {
              const int u = h * kVecs + v;
              const Vec m = (val[v] > best[u]) | val[v].isnan();
              best[u] = Vec::blendv(best[u], val[v], m);
              bpos[u] = Vec::blendv(bpos[u], vp, m);
            }
          }
        });
        if (direct) {  // straight to the output
          for (int v = 0; v < kV; ++v) best[v].store(reinterpret_cast<acc_t*>(op) + c0 + v * Vec::size());
          store_positions<pos_t>(bpos, kV, pp + c0);
        } else {
          for (int v = 0; v < kV; ++v) {
            best[v].store(bm + c0 + v * Vec::size());
            bpos[v].store(bp + c0 + v * Vec::size());
          }
        }
      };
      // The next pixel's window (s[2] input pixels on): its lines requested now, while this one is worked on
      // (wide pixels only: measured 8% faster at 64 fp32 channels, slower at 16).
#if defined(__AVX2__)
      if (prefetch)  // (an address past the input is harmless to a prefetch: computed as an integer)
        for (int64_t j = 0; j < listed; ++j)
          for (int64_t c = 0; c < C; c += kLine)
            _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(x) +
                                                       (woff[j] + next + c) * sizeof(scalar_t)),
                         _MM_HINT_T0);
#endif
      for (int64_t c0 = 0; c0 < C16; c0 += 16) block(c0, std::integral_constant<int, 16>{});
      if (C16 < C) {  // the other channels, through the arrays
        const int64_t rest = C - C16;
        for (int64_t c = C16; c < C; ++c) {
          bm[c] = ninf;
          bp[c] = p0;
        }
        each([&](const scalar_t* in, acc_t pv) {
          const acc_t* src;
          if constexpr (std::is_same_v<scalar_t, acc_t>) {
            src = in + C16;
          } else {
            for (int64_t c = 0; c < rest; ++c) tmp[c] = static_cast<acc_t>(in[C16 + c]);
            src = tmp;
          }
          max_update<acc_t>(src, bm + C16, bp + C16, rest, pv);
        });
      }
      for (int64_t c = direct ? C16 : 0; c < C; ++c) {
        op[c] = round_out<scalar_t, acc_t>(bm[c], c < nan_len);
        pp[c] = static_cast<pos_t>(bp[c]);
      }
      const bool tail_moves = depthless_tail && sd.start > 0;
      if (tail_moves) {
        for (int64_t c = vec_len; c < C; ++c)
          if (bm[c] == ninf) pp[c] = static_cast<pos_t>(o.kvol);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ backward

// Flat offset (within a plane, in elements of the spatial grid) of each window position from the window's
// origin; empty when the window is too large for a table (then positions are decoded by division).
std::vector<int64_t> offset_table(const PoolOptions& o, const Geometry& g) {
  std::vector<int64_t> t;
  if (o.kvol > 65536) return t;
  t.resize(o.kvol);
  for (int64_t kd = 0, i = 0; kd < o.k[0]; ++kd)
    for (int64_t kh = 0; kh < o.k[1]; ++kh)
      for (int64_t kw = 0; kw < o.k[2]; ++kw, ++i) t[i] = (kd * o.d[0] * g.H + kh * o.d[1]) * g.W + kw * o.d[2];
  return t;
}

// The spatial flat index of window position `p` of output (od, oh, ow), or -1 when it lies outside the input
// (possible only for an empty window).
inline int64_t target(int64_t p, const PoolOptions& o, const Geometry& g, int64_t od, int64_t oh, int64_t ow) {
  const int64_t kw = p % o.k[2], kh = (p / o.k[2]) % o.k[1], kd = p / (o.k[2] * o.k[1]);
  const int64_t id = od * o.s[0] - o.p[0] + kd * o.d[0], ih = oh * o.s[1] - o.p[1] + kh * o.d[1],
                iw = ow * o.s[2] - o.p[2] + kw * o.d[2];
  if (id < 0 || id >= g.D || ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) return -1;
  return (id * g.H + ih) * g.W + iw;
}

template <typename scalar_t, typename pos_t>
void backward_contiguous(const scalar_t* go, const pos_t* pos, scalar_t* gi, const Geometry& g, const PoolOptions& o) {
  const int64_t in_plane = g.D * g.H * g.W, out_plane = g.OD * g.OH * g.OW;
  const int64_t planes = g.N * g.C;
  const std::vector<int64_t> table = g.checked ? std::vector<int64_t>() : offset_table(o, g);
  const int64_t* tb = table.data();
  const bool use_table = !table.empty();
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, in_plane + out_plane));
  at::parallel_for(0, planes, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      scalar_t* gp = gi + c * in_plane;
      std::memset(static_cast<void*>(gp), 0, sizeof(scalar_t) * in_plane);
      const scalar_t* gop = go + c * out_plane;
      const pos_t* pp = pos + c * out_plane;
      for (int64_t od = 0; od < g.OD; ++od) {
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          const int64_t o0 = (od * g.OH + oh) * g.OW;
          if (use_table) {
            const int64_t row0 = ((od * o.s[0] - o.p[0]) * g.H + (oh * o.s[1] - o.p[1])) * g.W - o.p[2];
            for (int64_t ow = 0; ow < g.OW; ++ow) {
              const int64_t t = row0 + ow * o.s[2] + tb[static_cast<int64_t>(pp[o0 + ow])];
              gp[t] += gop[o0 + ow];
            }
          } else {
            for (int64_t ow = 0; ow < g.OW; ++ow) {
              const int64_t t = target(static_cast<int64_t>(pp[o0 + ow]), o, g, od, oh, ow);
              if (t >= 0) gp[t] += gop[o0 + ow];
            }
          }
        }
      }
    }
  });
}

template <typename scalar_t, typename pos_t>
void backward_channels_last(const scalar_t* go, const pos_t* pos, scalar_t* gi, const Geometry& g,
                            const PoolOptions& o) {
  const int64_t C = g.C, in_sp = g.D * g.H * g.W, out_sp = g.OD * g.OH * g.OW;
  const std::vector<int64_t> table = g.checked ? std::vector<int64_t>() : offset_table(o, g);
  const int64_t* tb = table.data();
  const bool use_table = !table.empty();
  // Stock's 3-d channels_last start for an all -inf window in its scalar channels (see forward_channels_last).
  const int64_t kvol = o.nd == 3 ? o.kvol : -1;
  auto depthless = [&](int64_t oh, int64_t ow) -> int64_t {
    const int64_t h = span(oh, o.s[1], o.p[1], o.k[1], o.d[1], g.H).start;
    const int64_t w = span(ow, o.s[2], o.p[2], o.k[2], o.d[2], g.W).start;
    return h < g.H && w < g.W ? h * g.W + w : -1;
  };
  // Tasks: (sample, block of channels); each adds into its own elements in stock's order (outputs row-major).
  const int64_t threads = at::get_num_threads();
  int64_t cb = C;
  if (g.N < 2 * threads && C > 16) cb = std::max<int64_t>(16, (C + 2 * threads - 1) / (2 * threads));
  const int64_t blocks = (C + cb - 1) / cb;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, (in_sp + out_sp) * cb));
  at::parallel_for(0, g.N * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * cb, c1 = std::min(C, c0 + cb);
      scalar_t* gn = gi + n * in_sp * C;
      if (c0 == 0 && c1 == C)
        std::memset(static_cast<void*>(gn), 0, sizeof(scalar_t) * in_sp * C);
      else
        for (int64_t s = 0; s < in_sp; ++s)
          std::memset(static_cast<void*>(gn + s * C + c0), 0, sizeof(scalar_t) * (c1 - c0));
      for (int64_t od = 0; od < g.OD; ++od) {
        for (int64_t oh = 0; oh < g.OH; ++oh) {
          for (int64_t ow = 0; ow < g.OW; ++ow) {
            const int64_t oi = ((n * g.OD + od) * g.OH + oh) * g.OW + ow;
            const scalar_t* gg = go + oi * C;
            const pos_t* pp = pos + oi * C;
            if (use_table) {
              const int64_t origin = ((od * o.s[0] - o.p[0]) * g.H + (oh * o.s[1] - o.p[1])) * g.W +
                                     (ow * o.s[2] - o.p[2]);
              if (kvol < 0) {  // 2-d: every position is in the table
                for (int64_t c = c0; c < c1; ++c) gn[(origin + tb[static_cast<int64_t>(pp[c])]) * C + c] += gg[c];
              } else {
                for (int64_t c = c0; c < c1; ++c) {
                  const int64_t p = static_cast<int64_t>(pp[c]);
                  const int64_t t = p == kvol ? depthless(oh, ow) : origin + tb[p];
                  gn[t * C + c] += gg[c];
                }
              }
            } else {
              for (int64_t c = c0; c < c1; ++c) {
                const int64_t p = static_cast<int64_t>(pp[c]);
                const int64_t t = p == kvol ? depthless(oh, ow) : target(p, o, g, od, oh, ow);
                if (t >= 0) gn[t * C + c] += gg[c];
              }
            }
          }
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------ dispatch

#define SG_DISPATCH_POS(TYPE, NAME, ...)                                                  \
  [&] {                                                                                   \
    switch (TYPE) {                                                                       \
      case at::kByte: {                                                                   \
        using pos_t = uint8_t;                                                            \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kShort: {                                                                  \
        using pos_t = int16_t;                                                            \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kInt: {                                                                    \
        using pos_t = int32_t;                                                            \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      default:                                                                            \
        TORCH_CHECK(false, NAME, ": unsupported position dtype ", TYPE);                  \
    }                                                                                     \
  }()

struct ForwardResult {
  at::Tensor out, pos;
};

ForwardResult run_forward(const at::Tensor& x4, const Geometry& g, const PoolOptions& o) {
  ForwardResult r;
  r.out = at::empty_strided(g.out_sizes, g.out_strides, x4.options());
  r.pos = at::empty_strided(g.out_sizes, g.out_strides, x4.options().dtype(o.pos_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x4.scalar_type(), "max_pool_forward", [&] {
    SG_DISPATCH_POS(o.pos_dtype, "max_pool_forward", [&] {
      const scalar_t* xp = x4.const_data_ptr<scalar_t>();
      scalar_t* op = r.out.data_ptr<scalar_t>();
      pos_t* pp = r.pos.data_ptr<pos_t>();
      if (g.channels_last)
        forward_channels_last<scalar_t, pos_t>(xp, op, pp, g, o);
      else
        forward_contiguous<scalar_t, pos_t>(xp, op, pp, g, o);
    });
  });
  return r;
}

at::Tensor run_backward(const at::Tensor& grad, const at::Tensor& pos, const Geometry& g, const PoolOptions& o) {
  // grad in the kernels' layout: contiguous, or channels_last of the internal (1-d: unsqueezed) shape.
  at::Tensor gk;
  if (!g.channels_last) {
    gk = grad.contiguous();
  } else {
    at::Tensor gi4 = o.nd == 1 ? grad.unsqueeze(-2) : grad;
    const auto fmt = gi4.dim() == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast;
    gk = gi4.contiguous(fmt);
  }
  at::Tensor gi = at::empty_strided(g.x_sizes, g.x_strides, grad.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "max_pool_backward", [&] {
    SG_DISPATCH_POS(pos.scalar_type(), "max_pool_backward", [&] {
      const scalar_t* gp = gk.const_data_ptr<scalar_t>();
      const pos_t* pp = pos.const_data_ptr<pos_t>();
      scalar_t* ip = gi.data_ptr<scalar_t>();
      if (g.channels_last)
        backward_channels_last<scalar_t, pos_t>(gp, pp, ip, g, o);
      else
        backward_contiguous<scalar_t, pos_t>(gp, pp, ip, g, o);
    });
  });
  return gi;
}

// Geometry and options travel to backward as one int list in ctx->saved_data.
std::vector<int64_t> pack(const Geometry& g, const PoolOptions& o) {
  std::vector<int64_t> v = {o.nd,   o.k[0], o.k[1], o.k[2], o.s[0], o.s[1], o.s[2], o.p[0], o.p[1], o.p[2],
                            o.d[0], o.d[1], o.d[2], o.ceil_mode, g.N, g.C, g.D, g.H, g.W, g.OD, g.OH, g.OW,
                            g.channels_last, g.checked, (int64_t)g.x_sizes.size()};
  v.insert(v.end(), g.x_sizes.begin(), g.x_sizes.end());
  v.insert(v.end(), g.x_strides.begin(), g.x_strides.end());
  return v;
}

void unpack(const std::vector<int64_t>& v, Geometry& g, PoolOptions& o) {
  o.nd = v[0];
  for (int i = 0; i < 3; ++i) {
    o.k[i] = v[1 + i];
    o.s[i] = v[4 + i];
    o.p[i] = v[7 + i];
    o.d[i] = v[10 + i];
  }
  o.ceil_mode = v[13];
  o.kvol = o.k[0] * o.k[1] * o.k[2];
  g.N = v[14];
  g.C = v[15];
  g.D = v[16];
  g.H = v[17];
  g.W = v[18];
  g.OD = v[19];
  g.OH = v[20];
  g.OW = v[21];
  g.channels_last = v[22];
  g.checked = v[23];
  const int64_t r = v[24];
  g.x_sizes.assign(v.begin() + 25, v.begin() + 25 + r);
  g.x_strides.assign(v.begin() + 25 + r, v.begin() + 25 + 2 * r);
}

struct MaxPoolFunction : public torch::autograd::Function<MaxPoolFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const PoolOptions* o, const Geometry* g,
                            const at::Tensor* x4) {
    ForwardResult r = run_forward(*x4, *g, *o);
    ctx->save_for_backward({r.pos});
    ctx->saved_data["g"] = pack(*g, *o);
    return r.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    const at::Tensor pos = ctx->get_saved_variables()[0];
    Geometry g;
    PoolOptions o;
    unpack(ctx->saved_data["g"].toIntVector(), g, o);
    at::Tensor gi = run_backward(grads[0], pos, g, o);
    return once_differentiable({gi, at::Tensor(), at::Tensor(), at::Tensor()}, grads, "MaxPoolFunction");
  }
};

// The eager call: the output, or None where the Python Function must run.
pybind11::object max_pool(const at::Tensor& x, const PoolOptions& o) {
  at::Tensor x4;
  auto g = prepare(x, o, x4, false);
  if (!g) return pybind11::none();
  return pybind11::cast(MaxPoolFunction::apply(x, &o, &*g, &x4));
}

// The max_pool_positions kernel contract (slimgrad.kernels.max_pool): contiguous in, contiguous out; None where
// this file does not serve the call (the caller then runs the torch reference, which raises stock's errors).
pybind11::object positions_forward(const at::Tensor& x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                                   std::vector<int64_t> padding, std::vector<int64_t> dilation, bool ceil_mode) {
  const int64_t nd = kernel.size();
  PoolOptions o = make_options(nd, kernel, stride, padding, dilation, ceil_mode, false);
  at::Tensor x4;
  auto g = prepare(x, o, x4, true);
  if (!g) return pybind11::none();
  ForwardResult r = run_forward(x4, *g, o);
  return pybind11::make_tuple(r.out, r.pos);
}

pybind11::object positions_backward(const at::Tensor& grad, const at::Tensor& pos, std::vector<int64_t> x_shape,
                                    std::vector<int64_t> kernel, std::vector<int64_t> stride,
                                    std::vector<int64_t> padding, std::vector<int64_t> dilation, bool ceil_mode) {
  const int64_t nd = kernel.size();
  PoolOptions o = make_options(nd, kernel, stride, padding, dilation, ceil_mode, false);
  if (!o.valid || pos.scalar_type() != o.pos_dtype || !pos.is_contiguous()) return pybind11::none();
  // prepare reads only x's shape (and its layout, contiguous here): a meta tensor of that shape serves.
  at::Tensor like = at::empty(x_shape, grad.options().device(at::kMeta));
  at::Tensor unused;
  auto g = prepare(like, o, unused, true);
  if (!g || grad.sizes() != at::IntArrayRef(g->out_sizes) || pos.sizes() != grad.sizes())
    return pybind11::none();
  return pybind11::cast(run_backward(grad, pos, *g, o));
}

}  // namespace

static Register reg_max_pool([](pybind11::module_& m) {
  pybind11::class_<PoolOptions>(m, "MaxPoolOptions")
      .def_readonly("valid", &PoolOptions::valid)
      .def_readonly("nd", &PoolOptions::nd);
  m.def("max_pool_options", &make_options,
        "max pooling options (nd; kernel, stride, padding, dilation as nd ints; ceil_mode; return_indices), "
        "checked once");
  m.def("max_pool_apply", &max_pool, "slimgrad max pooling: one C++ autograd Function call, or None");
  m.def("max_pool_positions_forward", &positions_forward);
  m.def("max_pool_positions_backward", &positions_backward);
});

}  // namespace slimgrad
