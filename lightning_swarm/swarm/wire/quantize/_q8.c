/* The codec's fast 8-bit kernels (see quantize.py): bitsandbytes' blockwise dynamic quantization, bit for bit.
 *
 * bitsandbytes' CPU quantizer normalises each value by its block's absmax and then finds its code with a
 * bucketed search plus a nearest-neighbour fix-up, ~11 ns per element. The result depends only on the
 * normalised float32 value v, so quantize.py tabulates that mapping once, from bitsandbytes' own kernel,
 * by the top 16 bits of v: within each such bucket of floats the code changes at most once, at a threshold
 * found by bisection (checked for every float in [-1, 1] by benchmarks/quantizer_exhaustive.py). Here a
 * value costs a division and one lookup in a 256 KB table.
 *
 * Built by quantize.py with the system C compiler on first use (plain C99, no Python headers); without a
 * compiler the codec calls bitsandbytes' kernels instead, with the same output.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* One entry per top 16 bits k of a normalised value v (bits b): a value whose low 16 bits are >= T takes code X,
 * the others code Y. Entry = T | Y << 16 | X << 24, with T in [0, 0xFFFF] (T = 0: every value takes X). quantize.py
 * derives it from the bucket's threshold in value order (for a negative bucket the order of the low bits is
 * reversed), so that the lookup compares integers. */
#define LS_MAX_BLOCK 4096
#define LS_LOOKUP(j)                                                                                    \
    {                                                                                                   \
        const uint32_t b = bits[i + (j)];                                                               \
        const uint32_t e = table[b >> 16];                                                              \
        out[i + (j)] = (uint8_t)((b & 0xFFFFu) >= (e & 0xFFFFu) ? (e >> 24) : (e >> 16));               \
    }

/* codes[i] and absmax[block] of x[0:n], exactly as bitsandbytes' quantize_cpu(code, x, absmax, codes, blocksize, n) */
void ls_quantize(const float *x, int64_t n, int64_t blocksize, const uint32_t *table, float *absmax,
                 uint8_t *codes) {
    uint32_t bits[LS_MAX_BLOCK];
    for (int64_t start = 0; start < n; start += blocksize) {
        const int64_t len = (n - start < blocksize) ? n - start : blocksize;
        const float *xb = x + start;
        /* bitsandbytes: absmax = fmax(absmax, fabs(x)) from -FLT_MAX. `a > m ? a : m` skips NaN alike, and a
         * maximum does not depend on the order: eight running maxima let the compiler vectorize the loop */
        float lane[8] = {-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX};
        int64_t i = 0;
        for (; i + 8 <= len; i += 8)
            for (int j = 0; j < 8; j++) {
                const float a = fabsf(xb[i + j]);
                lane[j] = a > lane[j] ? a : lane[j];
            }
        for (; i < len; i++) {
            const float a = fabsf(xb[i]);
            lane[0] = a > lane[0] ? a : lane[0];
        }
        float m = lane[0];
        for (int j = 1; j < 8; j++) m = lane[j] > m ? lane[j] : m;
        absmax[start / blocksize] = m;
        for (i = 0; i < len; i++) { /* the same division as bitsandbytes (a reciprocal would round differently) */
            const float v = xb[i] / m;
            memcpy(&bits[i], &v, sizeof v);
        }
        /* NaN (0 / 0 in a block of zeros, or a NaN input) falls in buckets whose entries give code 0 */
        uint8_t *out = codes + start;
        for (i = 0; i + 4 <= len; i += 4) { /* four independent lookups per iteration: ~2x the plain loop */
            LS_LOOKUP(0)
            LS_LOOKUP(1)
            LS_LOOKUP(2)
            LS_LOOKUP(3)
        }
        for (; i < len; i++) LS_LOOKUP(0)
    }
}

/* x[i] = code[codes[i]] * absmax[block], exactly as bitsandbytes' dequantize_blockwise_cpu_fp32: the 256 products
 * of a block are made once (the same multiplications) and looked up */
void ls_dequantize(const float *code, const uint8_t *codes, const float *absmax, float *out, int64_t n,
                   int64_t blocksize) {
    float scaled[256];
    for (int64_t start = 0; start < n; start += blocksize) {
        const int64_t len = (n - start < blocksize) ? n - start : blocksize;
        const float scale = absmax[start / blocksize];
        for (int j = 0; j < 256; j++) scaled[j] = code[j] * scale;
        const uint8_t *cb = codes + start;
        float *ob = out + start;
        int64_t i = 0;
        for (; i + 4 <= len; i += 4) {
            ob[i] = scaled[cb[i]];
            ob[i + 1] = scaled[cb[i + 1]];
            ob[i + 2] = scaled[cb[i + 2]];
            ob[i + 3] = scaled[cb[i + 3]];
        }
        for (; i < len; i++) ob[i] = scaled[cb[i]];
    }
}
