// Ferry's scattered copy: one launch moves a whole list of (src, dst, len),
// so thousands of small KV-cache blocks cost one launch, not one DMA each.
//
// ferry_copy_layouts does the same for blocks of two layouts named by
// index, computing each block's addresses on the GPU.
//
// Compiled to PTX by gen-ptx.py (NVRTC, compute_75) and shipped inside the
// CUDA plugins through ferry-cuda-driver (src/copy.ptx, include_str!); the
// driver JITs it for the GPU at cuModuleLoadData. The host splits entries
// longer than
// FERRY_COPY_PIECE (src/kernel.rs) on the host, so every entry is short and
// one warp per entry keeps every SM busy. The layout of ferry_copy matches
// `Desc` in src/kernel.rs.

typedef unsigned long long u64;

struct ferry_copy {
    u64 src;
    u64 dst;
    u64 len;
};

// Words of type T, four loads in flight per lane before their stores;
// global-space, streaming (evict-first) accesses: each byte is touched once.
template <typename T>
__device__ __forceinline__ void copy_words(unsigned char *__restrict__ dst,
                                           const unsigned char *__restrict__ src,
                                           u64 bytes, unsigned lane) {
    const T *__restrict__ s = reinterpret_cast<const T *>(src);
    T *__restrict__ d = reinterpret_cast<T *>(dst);
    const u64 words = bytes / sizeof(T);
    u64 i = lane;
    for (; i + 96 < words; i += 128) {
        T a = __ldcs(s + i);
        T b = __ldcs(s + i + 32);
        T c = __ldcs(s + i + 64);
        T e = __ldcs(s + i + 96);
        __stcs(d + i, a);
        __stcs(d + i + 32, b);
        __stcs(d + i + 64, c);
        __stcs(d + i + 96, e);
    }
    for (; i < words; i += 32) __stcs(d + i, __ldcs(s + i));
}

// One warp moves one entry in the widest words its two addresses allow: a
// byte head brings both to a 16-, 8- or 4-byte boundary when they share it,
// a byte tail ends it.
__device__ __forceinline__ void copy_entry(u64 src, u64 dst, u64 n, unsigned lane) {
    const unsigned char *s = reinterpret_cast<const unsigned char *>(src);
    unsigned char *d = reinterpret_cast<unsigned char *>(dst);
    const u64 apart = src ^ dst;
    const unsigned w = (apart & 15) == 0 ? 16 : (apart & 7) == 0 ? 8 : (apart & 3) == 0 ? 4 : 1;
    u64 head = (w - (src & (w - 1))) & (w - 1);
    if (head > n) head = n;
    if (lane < head) d[lane] = s[lane];
    s += head;
    d += head;
    n -= head;
    const u64 body = n & ~static_cast<u64>(w - 1);
    switch (w) {
    case 16: copy_words<uint4>(d, s, body, lane); break;
    case 8: copy_words<uint2>(d, s, body, lane); break;
    case 4: copy_words<unsigned int>(d, s, body, lane); break;
    default: copy_words<unsigned char>(d, s, body, lane); break;
    }
    for (u64 j = body + lane; j < n; j += 32) d[j] = s[j];
}

// One warp per entry, grid-stride over the entries.
extern "C" __global__ void __launch_bounds__(256)
ferry_copy_list(const ferry_copy *__restrict__ list, unsigned int count) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned warps_per_block = blockDim.x >> 5;
    unsigned entry = blockIdx.x * warps_per_block + (threadIdx.x >> 5);
    const unsigned warps = gridDim.x * warps_per_block;
    for (; entry < count; entry += warps) {
        const ferry_copy c = list[entry];
        copy_entry(c.src, c.dst, c.len, lane);
    }
}

// Blocks of two layouts by index (`launch_layouts` in src/kernel.rs): block
// i moves `block` bytes from src_base + src_ids[i] * src_stride to dst_base
// + dst_ids[i] * dst_stride, in `pieces` pieces of at most `piece` bytes, so
// the addresses are computed here and not written per block by the host.
// One warp per piece, grid-stride over count * pieces.
extern "C" __global__ void __launch_bounds__(256)
ferry_copy_layouts(const u64 *__restrict__ src_ids, const u64 *__restrict__ dst_ids,
                   u64 src_base, u64 src_stride, u64 dst_base, u64 dst_stride, u64 block,
                   u64 piece, unsigned int count, unsigned int pieces) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned warps_per_block = blockDim.x >> 5;
    u64 item = static_cast<u64>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5);
    const u64 warps = static_cast<u64>(gridDim.x) * warps_per_block;
    const u64 items = static_cast<u64>(count) * pieces;
    for (; item < items; item += warps) {
        const u64 b = item / pieces;
        const u64 at = (item - b * pieces) * piece;
        const u64 left = block - at;
        copy_entry(src_base + src_ids[b] * src_stride + at, dst_base + dst_ids[b] * dst_stride + at,
                   left < piece ? left : piece, lane);
    }
}
