// The paged attention of specdec_cpu_ops.cc, as the layer stacks of specdec_quant_ops.cc call it:
// a step's metadata read and checked once, then one call per layer. The 30 layers of the
// default model's pass attend over the same requests, positions and blocks; reading and
// checking the metadata, and allocating the output, at every layer cost about 2 us a layer.
#pragma once

#include <cstdint>
#include <vector>

#include "paddle/extension.h"

// A step's attention metadata (specdec.kernels.cpu.packing.pack_attention_metadata), read once.
struct AttentionBatch {
  int64_t rows = 0;        // packed rows of the step (T)
  int64_t requests = 0;    // B
  int64_t max_blocks = 0;  // block-table entries per request
  std::vector<int32_t> tables;  // [B, max_blocks]
  std::vector<int32_t> cu;      // [B + 1]: request b's rows are cu[b] .. cu[b + 1] - 1
  std::vector<int32_t> ctx;     // [B]: positions already in the cache before its rows
};

// Reads `meta` int32 [B, 2 + max_blocks] (per request: its first packed row, its context
// length, its block table) for `rows` packed rows, and checks it against `cache`'s blocks and
// the RoPE table `cos`: a bad table is an error before any layer writes its cache.
AttentionBatch read_attention_batch(const paddle::Tensor& meta, int64_t rows, const paddle::Tensor& cache,
                                    const paddle::Tensor& cos);

// The same from the metadata's memory, `B` rows of `columns` int32 (2 + max_blocks).
AttentionBatch read_attention_batch(const int32_t* packed, int64_t B, int64_t columns, int64_t rows,
                                    const paddle::Tensor& cache, const paddle::Tensor& cos);

// Checks one layer's cache ([blocks, 2*kv_heads, block_size, D], float32 or float16, the same
// shape as `like`, the cache read_attention_batch checked) and its q/k/v width.
void check_attention_layer(const paddle::Tensor& cache, const paddle::Tensor& like, int64_t qkv_width,
                           int64_t heads, int64_t kv_heads);

// One layer's attention for the step: RoPE on the rows' query and key heads of qkv
// [rows, (heads + 2*kv_heads) * D], their keys and values written into `cache` (in place),
// then out [rows, heads * D]. The operands must have passed the two checks above.
void attend_layer(const AttentionBatch& batch, const float* qkv, const paddle::Tensor& cache,
                  const paddle::Tensor& cos, const paddle::Tensor& sin, int64_t heads, int64_t kv_heads, float* out);
