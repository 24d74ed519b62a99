// INT4 (W4A16) routed experts at decode: the gate/up GEMV with SiLU, then the down GEMV with the
// top-k sum, for one to a few tokens (kernels/int4_gemv_cuda.py compiles this with NVRTC and
// launches it; the contract is int4_moe.int4_moe_gemv's, shared experts included).
//
// Why CUDA and not Triton: at one token the GEMV must stream the experts' words at the memory's
// rate with about 1.7 instructions a weight to spare. The Triton kernels spend 4-5.6 (their
// nibble unpacking and the reductions Triton lays out), and Triton's pipeliner left the fp16-pair
// variant's activations as synchronous loads. Here a warp reads its rows' whole K into registers
// (ptxas overlaps those loads with the products, 4-6 in flight a warp), the activations sit in
// shared memory as fp16 pairs, converted once a block, and the dot product is the fp16-pair one
// the Triton kernels measured accurate enough (int4_moe._dot_group_f16x2_asm). Measured on an
// H200 (BENCHMARKS.md, 2026-12-07): 1.02-1.69x the Triton GEMV at 1-4 tokens on K2.6's layouts.
//
// Layout (int4_moe's): w13 int32 [E, 2I, H/8] (gate rows then up rows), s13 [E, 2I, H/32];
// w2 int32 [E, H, I/8], s2 [E, H, I/32]; words in the kernels' nibble order, so the nibbles at
// bits 4j and 4j + 16 of a word are neighbouring elements 2j and 2j + 1 of its 8, and one uint4
// (four words) is one scale group of 32. Scales and activations in the activation dtype.
//
// Compile-time constants (-D): ACT_BF16 (1: bf16 activations, 0: fp16), IDX_T (the ids' C type),
// HIDDEN, INTER, TOPK, WARPS (a block's warps), GATE_ROWS (gate/up row pairs a warp),
// DOWN_ROWS (output rows a warp), DOWN_CHUNK (a down lane's groups loaded at once; 0: all),
// GATE_STAGE (1: the gate/up words copied to shared memory asynchronously, then read there),
// EARLY (1: a warp's first words are requested before the block converts its activations, so
// the memory is busy during that prologue and its barrier),
// DOWN_PREFETCH (1: a down lane requests its next chunk's words before this chunk's products),
// PDL (1: the down kernel is launched as a programmatic dependent of the gate/up one, sm_90+: its
// blocks start during the gate/up kernel's last wave, request their words, then wait for it),
// SHARED (the shared experts' width, in the activation dtype; 0: none).

typedef unsigned int u32;
typedef unsigned short u16;

#define GROUP 32
#define H_GROUPS (HIDDEN / GROUP)           // scale groups (uint4) of a gate/up row
#define GATE_ITERS ((H_GROUPS + 31) / 32)   // a lane's groups of a row
#define I_GROUPS (INTER / GROUP)            // scale groups of a down row's slot
#define DOWN_ITERS ((TOPK * I_GROUPS + 31) / 32)
#define DOWN_CHUNK_ITERS (DOWN_CHUNK > 0 && DOWN_CHUNK < DOWN_ITERS ? DOWN_CHUNK : DOWN_ITERS)
#define SHARED_SLOTS ((SHARED + INTER - 1) / INTER)  // the shared experts' rows in slots of INTER
#define SHARED_VECS (SHARED / 8)                     // uint4 (8 weights) of a shared down row
#define SHARED_ITERS ((SHARED_VECS + 31) / 32)

__device__ __forceinline__ float act_to_float(u16 v) {
#if ACT_BF16
  return __uint_as_float(((u32)v) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
#endif
}

__device__ __forceinline__ u16 float_to_act(float f) {
  u16 r;
#if ACT_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
  return r;
}

// Two activations (a pair of the activation dtype in one word, the first in the low half) times
// `w` -> an fp16 pair, clamped to fp16's range (the 1/256 in the dot keeps the sums finite then).
__device__ __forceinline__ u32 fp16_pair(u32 v, float w) {
  float lo = act_to_float((u16)(v & 0xffffu)) * w, hi = act_to_float((u16)(v >> 16)) * w;
  lo = fminf(fmaxf(lo, -65504.f), 65504.f);
  hi = fminf(fmaxf(hi, -65504.f), 65504.f);
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ u32 hadd2(u32 a, u32 b) {
  u32 d;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The nibbles under `mask` (bits 4j and 4j + 16, j even or odd) OR-ed into fp16 1024 (ulp 1),
// then to (nibble - 8) / 256 with one exact FMA: 0x1c00 = 2^-8, 0xc408 = -(1024 + 8) / 256 for
// the low nibble of a byte; 0x0c00 = 2^-12, 0xb480 = -(1/4 + 8/256) for the high one (its pair
// reads 1024 + 16 * nibble).
__device__ __forceinline__ u32 nibble_pair_lo(u32 w) {
  u32 t;
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(t) : "r"(w));
  return hfma2(t, 0x1c001c00u, 0xc408c408u);
}

__device__ __forceinline__ u32 nibble_pair_hi(u32 w) {
  u32 t;
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(t) : "r"(w));
  return hfma2(t, 0x0c000c00u, 0xb480b480u);
}

// One packed word against its 4 fp16 activation pairs: the products' sum in a half2 (x 1/256).
__device__ __forceinline__ u32 dot_word(u32 w, uint4 a) {
  u32 s = hmul2(nibble_pair_lo(w), a.x);
  s = hfma2(nibble_pair_hi(w), a.y, s);
  u32 h = w >> 8;
  s = hfma2(nibble_pair_lo(h), a.z, s);
  return hfma2(nibble_pair_hi(h), a.w, s);
}

// One scale group (a uint4 of words) against its 16 activation pairs: its sum / 256 in fp32.
// Four short half2 chains (one a word), added, then the halves in fp32.
__device__ __forceinline__ float dot_group(uint4 w, uint4 a0, uint4 a1, uint4 a2, uint4 a3) {
  u32 s = hadd2(hadd2(dot_word(w.x, a0), dot_word(w.y, a1)), hadd2(dot_word(w.z, a2), dot_word(w.w, a3)));
  float lo, hi;
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}" : "=f"(lo), "=f"(hi) : "r"(s));
  return lo + hi;
}

// 8 bf16 / fp16 weights (a uint4) against their 4 fp16 activation pairs, in fp32.
__device__ __forceinline__ float dense_dot8(uint4 w, uint4 a) {
  const u32 wv[4] = {w.x, w.y, w.z, w.w}, av[4] = {a.x, a.y, a.z, a.w};
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float al, ah;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}" : "=f"(al), "=f"(ah) : "r"(av[j]));
    acc = fmaf(act_to_float((u16)(wv[j] & 0xffffu)), al, acc);
    acc = fmaf(act_to_float((u16)(wv[j] >> 16)), ah, acc);
  }
  return acc;
}

// A group's 16 pairs are four uint4 chunks in shared memory; chunk q of group g sits at
// 4g + (q ^ ((g >> 1) & 3)), so the 8 lanes of a quarter warp reading chunk q of neighbouring
// groups hit 32 different banks.
__device__ __forceinline__ int chunk_at(int g, int q) { return 4 * g + (q ^ ((g >> 1) & 3)); }

// The experts' words and scales are read once: not kept in L1.
__device__ __forceinline__ uint4 load_words(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 16 bytes from global to shared memory, asynchronously (sm_80+), kept out of L1.
__device__ __forceinline__ void copy_async(uint4* dst, const uint4* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ u16 load_scale(const u16* p) {
  u16 v;
  asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A token's activations into shared memory as fp16 pairs (see chunk_at), by the whole block.
__device__ __forceinline__ void activations_to_shared(const u16* __restrict__ x_row, uint4* xs) {
  const u32* xw = (const u32*)x_row;
  u32* xs32 = (u32*)xs;
  for (int p = threadIdx.x; p < HIDDEN / 2; p += WARPS * 32) {
    const int g = p >> 4;
    xs32[chunk_at(g, (p >> 2) & 3) * 4 + (p & 3)] = fp16_pair(xw[p], 1.f);
  }
}

#if SHARED
// A shared-expert block of the gate/up kernel: slot j of a token covers the shared experts' rows
// [j * INTER, (j + 1) * INTER) (those below SHARED), 16-bit weights ``sw13 [2 * SHARED, HIDDEN]``
// (gate rows then up rows); a warp's row pair is read a few groups at a time.
__device__ void shared_gate_up(const u16* __restrict__ x, const uint4* __restrict__ sw13, u16* __restrict__ inter,
                               int x_stride, int out_row, int token, int j, uint4* xs) {
  activations_to_shared(x + (long long)token * x_stride, xs);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int rr = 0; rr < GATE_ROWS; ++rr) {
    const int i = (blockIdx.x * WARPS + warp) * GATE_ROWS + rr, r = j * INTER + i;
    if (i >= INTER || r >= SHARED) return;  // warp-uniform
    const uint4* gate_row = sw13 + (long long)r * (HIDDEN / 8);
    const uint4* up_row = sw13 + (long long)(SHARED + r) * (HIDDEN / 8);
    float gate = 0.f, up = 0.f;
#pragma unroll 2
    for (int it = 0; it < GATE_ITERS; ++it) {
      const int g = it * 32 + lane;
      if (H_GROUPS % 32 == 0 || g < H_GROUPS) {
        uint4 wg[4], wu[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) wg[q] = load_words(gate_row + 4 * g + q), wu[q] = load_words(up_row + 4 * g + q);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint4 a = xs[chunk_at(g, q)];
          gate += dense_dot8(wg[q], a);
          up += dense_dot8(wu[q], a);
        }
      }
    }
    gate = warp_sum(gate);
    up = warp_sum(up);
    if (lane == 0) inter[(long long)out_row * INTER + i] = float_to_act(gate / (1.f + expf(-gate)) * up);
  }
}
#endif

// A gate/up warp's row pairs (gate row r, up row INTER + r of its expert), a lane's groups of each,
// into registers: words and scales.
__device__ __forceinline__ void load_gate_rows(const uint4* __restrict__ w13, const u16* __restrict__ s13, long long expert_rows,
                                               int first_row, int lane, uint4 (&w)[2 * GATE_ROWS][GATE_ITERS],
                                               u16 (&s)[2 * GATE_ROWS][GATE_ITERS]) {
#pragma unroll
  for (int k = 0; k < 2 * GATE_ROWS; ++k) {
    const int r = first_row + (k >> 1);
    const long long row = expert_rows + (k & 1) * INTER + (r < INTER ? r : INTER - 1);
    const uint4* wr = w13 + row * H_GROUPS;
    const u16* sr = s13 + row * H_GROUPS;
#pragma unroll
    for (int it = 0; it < GATE_ITERS; ++it) {
      const int g = it * 32 + lane;
      if (H_GROUPS % 32 == 0 || g < H_GROUPS) {
        w[k][it] = load_words(wr + g);
        s[k][it] = load_scale(sr + g);
      }
    }
  }
}

// grid (ceil(INTER / (WARPS * GATE_ROWS)), T * (TOPK + SHARED_SLOTS)); a block: one (token, slot), WARPS * GATE_ROWS
// row pairs (gate row i, up row INTER + i) -> inter[pair, i] = silu(gate) * up. Another rank's
// expert: the block returns at once (the down kernel skips the slot). The shared experts' slots
// (SHARED > 0) follow the routed ones: rows T * TOPK + token * SHARED_SLOTS + j of ``inter``.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
int4_gate_up(const u16* __restrict__ x, const uint4* __restrict__ w13, const u16* __restrict__ s13,
             const IDX_T* __restrict__ ids, u16* __restrict__ inter, int x_stride, int first_expert, int num_local,
             const uint4* __restrict__ sw13, int tokens) {
#if GATE_STAGE
  // Dynamic shared memory: the activations, then each warp's rows as its lanes copied them.
  extern __shared__ uint4 smem[];
  uint4* xs = smem;
  uint4* staged = smem + H_GROUPS * 4 + (threadIdx.x >> 5) * (2 * GATE_ROWS * GATE_ITERS * 32);
#else
  __shared__ uint4 xs[H_GROUPS * 4];
#endif
  const int pair = blockIdx.y;
#if PDL
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the down kernel may launch
#endif
#if SHARED
  if (pair >= tokens * TOPK) {
    shared_gate_up(x, sw13, inter, x_stride, pair, (pair - tokens * TOPK) / SHARED_SLOTS, (pair - tokens * TOPK) % SHARED_SLOTS, xs);
    return;
  }
#endif
  const int token = pair / TOPK;
  const long long e = (long long)ids[pair] - first_expert;
  if (e < 0 || e >= num_local) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first_row = (blockIdx.x * WARPS + warp) * GATE_ROWS;
  const long long expert_rows = e * 2 * INTER;
  uint4 w[2 * GATE_ROWS][GATE_ITERS];
  u16 s[2 * GATE_ROWS][GATE_ITERS];
#if GATE_STAGE
  // The words' copies (and the scales' loads) start before the activations' conversion and
  // barrier: asynchronous (cp.async), so all of a warp's rows are in flight at once whatever the
  // compiler schedules.
  if (first_row < INTER) {
#pragma unroll
    for (int k = 0; k < 2 * GATE_ROWS; ++k) {
      const int r = first_row + (k >> 1);
      const long long row = expert_rows + (k & 1) * INTER + (r < INTER ? r : INTER - 1);
#pragma unroll
      for (int it = 0; it < GATE_ITERS; ++it) {
        const int g = it * 32 + lane;
        if (H_GROUPS % 32 == 0 || g < H_GROUPS) {
          copy_async(staged + (k * GATE_ITERS + it) * 32 + lane, w13 + row * H_GROUPS + g);
          s[k][it] = load_scale(s13 + row * H_GROUPS + g);
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
#endif

#if !GATE_STAGE && EARLY
  if (first_row < INTER) load_gate_rows(w13, s13, expert_rows, first_row, lane, w, s);
#endif
  activations_to_shared(x + (long long)token * x_stride, xs);
  __syncthreads();
  if (first_row >= INTER) return;

#if GATE_STAGE
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // a lane reads back only its own copies
#pragma unroll
  for (int k = 0; k < 2 * GATE_ROWS; ++k)
#pragma unroll
    for (int it = 0; it < GATE_ITERS; ++it)
      if (H_GROUPS % 32 == 0 || it * 32 + lane < H_GROUPS) w[k][it] = staged[(k * GATE_ITERS + it) * 32 + lane];
#elif !EARLY
  load_gate_rows(w13, s13, expert_rows, first_row, lane, w, s);
#endif

  float acc[2 * GATE_ROWS];
#pragma unroll
  for (int k = 0; k < 2 * GATE_ROWS; ++k) acc[k] = 0.f;
#pragma unroll
  for (int it = 0; it < GATE_ITERS; ++it) {
    const int g = it * 32 + lane;
    if (H_GROUPS % 32 == 0 || g < H_GROUPS) {
      const uint4 a0 = xs[chunk_at(g, 0)], a1 = xs[chunk_at(g, 1)], a2 = xs[chunk_at(g, 2)], a3 = xs[chunk_at(g, 3)];
#pragma unroll
      for (int k = 0; k < 2 * GATE_ROWS; ++k) acc[k] += dot_group(w[k][it], a0, a1, a2, a3) * act_to_float(s[k][it]);
    }
  }
#pragma unroll
  for (int rr = 0; rr < GATE_ROWS; ++rr) {
    const float gate = warp_sum(acc[2 * rr]) * 256.f, up = warp_sum(acc[2 * rr + 1]) * 256.f;
    const int r = first_row + rr;
    if (lane == 0 && r < INTER) inter[(long long)pair * INTER + r] = float_to_act(gate / (1.f + expf(-gate)) * up);
  }
}

// A down warp's rows (first_row.., of the expert whose rows start at ``expert_rows``), group c of
// each, into chunk slot j of the registers.
__device__ __forceinline__ void load_down_rows(const uint4* __restrict__ w2, const u16* __restrict__ s2, long long expert_rows,
                                               int first_row, int c, int j, uint4 (&w)[DOWN_ROWS][DOWN_CHUNK_ITERS],
                                               u16 (&s)[DOWN_ROWS][DOWN_CHUNK_ITERS]) {
#pragma unroll
  for (int rr = 0; rr < DOWN_ROWS; ++rr) {
    const int h = first_row + rr < HIDDEN ? first_row + rr : HIDDEN - 1;
    w[rr][j] = load_words(w2 + (expert_rows + h) * I_GROUPS + c);
    s[rr][j] = load_scale(s2 + (expert_rows + h) * I_GROUPS + c);
  }
}

// grid (ceil(HIDDEN / (WARPS * DOWN_ROWS)), T); a block: DOWN_ROWS output rows a warp of one token,
// each summing its local slots' rows: out[token, h] = sum_slots weight * (w2[e, h] . inter[slot]).
// The route weights ride on the activations (multiplied before their fp16 rounding). With shared
// experts (SHARED > 0) each output row adds their down row. Dynamic shared memory: TOPK * INTER
// fp16 activations (only the local slots' are filled), then SHARED.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
int4_down(const u16* __restrict__ inter, const uint4* __restrict__ w2, const u16* __restrict__ s2,
          const IDX_T* __restrict__ ids, const float* __restrict__ weights, u16* __restrict__ out,
          int out_stride, int first_expert, int num_local, const uint4* __restrict__ sw2, int tokens) {
  extern __shared__ uint4 as[];
  __shared__ int local_slot[TOPK], local_expert[TOPK], local_count;
  const int token = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first_row = (blockIdx.x * WARPS + warp) * DOWN_ROWS;
  uint4 w[DOWN_ROWS][DOWN_CHUNK_ITERS];
  u16 s[DOWN_ROWS][DOWN_CHUNK_ITERS];
#if EARLY
  // The first chunk's words before the block's bookkeeping and activations: each lane finds its
  // groups' experts itself, from the token's ids in registers.
  if (first_row < HIDDEN) {
    long long local[TOPK];
    int count = 0;
#pragma unroll
    for (int j = 0; j < TOPK; ++j) {
      local[j] = (long long)ids[token * TOPK + j] - first_expert;
      count += local[j] >= 0 && local[j] < num_local;
    }
#pragma unroll
    for (int j = 0; j < DOWN_CHUNK_ITERS; ++j) {
      const int u = j * 32 + lane;
      if (j < DOWN_ITERS && u < count * I_GROUPS) {
        const int l = u / I_GROUPS, c = u % I_GROUPS;
        long long e = 0;
        int n = 0;
#pragma unroll
        for (int q = 0; q < TOPK; ++q) {
          const bool mine = local[q] >= 0 && local[q] < num_local;
          e = mine && n == l ? local[q] : e;
          n += mine;
        }
        load_down_rows(w2, s2, e * HIDDEN, first_row, c, j, w, s);
      }
    }
  }
#endif
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < TOPK; ++j) {
      const long long e = (long long)ids[token * TOPK + j] - first_expert;
      if (e >= 0 && e < num_local) {
        local_slot[n] = j;
        local_expert[n] = (int)e;
        ++n;
      }
    }
    local_count = n;
  }
#if PDL
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // the gate/up kernel's results, complete
#endif
  __syncthreads();
  const int n_local = local_count, n_groups = n_local * I_GROUPS;

  u32* as32 = (u32*)as;
  for (int p = threadIdx.x; p < n_local * (INTER / 2); p += WARPS * 32) {
    const int l = p / (INTER / 2), pp = p % (INTER / 2);
    const int slot = token * TOPK + local_slot[l];
    const u32 v = ((const u32*)(inter + (long long)slot * INTER))[pp];
    const int u = l * I_GROUPS + (pp >> 4);
    as32[chunk_at(u, (pp >> 2) & 3) * 4 + (pp & 3)] = fp16_pair(v, weights[slot]);
  }
#if SHARED
  // The shared experts' activations after the routed slots' region, in natural order (a lane
  // reads 16 consecutive bytes: no swizzle needed): slot j's first min(INTER, SHARED - j * INTER).
  u32* shared32 = as32 + TOPK * (INTER / 2);
  for (int p = threadIdx.x; p < SHARED / 2; p += WARPS * 32) {
    const int row = tokens * TOPK + token * SHARED_SLOTS + (2 * p) / INTER;
    shared32[p] = fp16_pair(((const u32*)(inter + (long long)row * INTER))[p % (INTER / 2)], 1.f);
  }
#endif
  __syncthreads();

  if (first_row >= HIDDEN) return;

  // The flattened (local slot, group) list in chunks of DOWN_CHUNK groups a lane (0: all at once):
  // a chunk's loads, then its products, so the registers hold one chunk's words (DOWN_PREFETCH:
  // two chunks', the next one's loads in flight during this one's products).
  float acc[DOWN_ROWS];
#pragma unroll
  for (int rr = 0; rr < DOWN_ROWS; ++rr) acc[rr] = 0.f;
#if DOWN_PREFETCH
  uint4 w_next[DOWN_ROWS][DOWN_CHUNK_ITERS];
  u16 s_next[DOWN_ROWS][DOWN_CHUNK_ITERS];
#endif
#pragma unroll
  for (int first_it = 0; first_it < DOWN_ITERS; first_it += DOWN_CHUNK_ITERS) {
#pragma unroll
    for (int j = 0; j < DOWN_CHUNK_ITERS; ++j) {
      const int u = (first_it + j) * 32 + lane;
      if ((!EARLY || first_it > 0) && (!DOWN_PREFETCH || first_it == 0) && first_it + j < DOWN_ITERS && u < n_groups)
        load_down_rows(w2, s2, (long long)local_expert[u / I_GROUPS] * HIDDEN, first_row, u % I_GROUPS, j, w, s);
#if DOWN_PREFETCH
      const int next = first_it + DOWN_CHUNK_ITERS + j, un = next * 32 + lane;
      if (next < DOWN_ITERS && un < n_groups)
        load_down_rows(w2, s2, (long long)local_expert[un / I_GROUPS] * HIDDEN, first_row, un % I_GROUPS, j, w_next, s_next);
#endif
    }
#pragma unroll
    for (int j = 0; j < DOWN_CHUNK_ITERS; ++j) {
      const int u = (first_it + j) * 32 + lane;
      if (first_it + j < DOWN_ITERS && u < n_groups) {
        const uint4 a0 = as[chunk_at(u, 0)], a1 = as[chunk_at(u, 1)], a2 = as[chunk_at(u, 2)], a3 = as[chunk_at(u, 3)];
#pragma unroll
        for (int rr = 0; rr < DOWN_ROWS; ++rr) acc[rr] += dot_group(w[rr][j], a0, a1, a2, a3) * act_to_float(s[rr][j]);
      }
    }
#if DOWN_PREFETCH
#pragma unroll
    for (int rr = 0; rr < DOWN_ROWS; ++rr)
#pragma unroll
      for (int j = 0; j < DOWN_CHUNK_ITERS; ++j) w[rr][j] = w_next[rr][j], s[rr][j] = s_next[rr][j];
#endif
  }
#pragma unroll
  for (int rr = 0; rr < DOWN_ROWS; ++rr) acc[rr] *= 256.f;
#if SHARED
  // The shared experts' down rows ``sw2 [HIDDEN, SHARED]``, two groups of 8 a lane at a time.
  const uint4* shared_acts = as + TOPK * I_GROUPS * 4;
#pragma unroll
  for (int first_it = 0; first_it < SHARED_ITERS; first_it += 2) {
    uint4 w[DOWN_ROWS][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int u = (first_it + j) * 32 + lane;
      if (first_it + j < SHARED_ITERS && u < SHARED_VECS) {
#pragma unroll
        for (int rr = 0; rr < DOWN_ROWS; ++rr) {
          const int h = first_row + rr < HIDDEN ? first_row + rr : HIDDEN - 1;
          w[rr][j] = load_words(sw2 + (long long)h * SHARED_VECS + u);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int u = (first_it + j) * 32 + lane;
      if (first_it + j < SHARED_ITERS && u < SHARED_VECS) {
        const uint4 a = shared_acts[u];
#pragma unroll
        for (int rr = 0; rr < DOWN_ROWS; ++rr) acc[rr] += dense_dot8(w[rr][j], a);
      }
    }
  }
#endif
#pragma unroll
  for (int rr = 0; rr < DOWN_ROWS; ++rr) {
    const float v = warp_sum(acc[rr]);
    const int h = first_row + rr;
    if (lane == 0 && h < HIDDEN) out[(long long)token * out_stride + h] = float_to_act(v);
  }
}
