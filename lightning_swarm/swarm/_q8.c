/* The codec's fast 8-bit kernels (see quantize.py): bitsandbytes' blockwise dynamic quantization, bit for bit.
 *
 * bitsandbytes' CPU quantizer normalises each value by its block's absmax and then finds its code with a
 * bucketed search plus a nearest-neighbour fix-up, ~11 ns per element. The result depends only on the
 * normalised float32 value v, so quantize.py tabulates that mapping once, from bitsandbytes' own kernel,
 * by the top 16 bits of v: within each such bucket of floats the code changes at most once, at a threshold
 * found by bisection (checked for every float in [-1, 1] by benchmarks/quantizer_exhaustive.py). Here a
 * value costs a division and one table lookup.
 *
 * Built by quantize.py with the system C compiler on first use (plain C99, no Python headers); without a
 * compiler the codec calls bitsandbytes' kernels instead, with the same output.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float threshold; /* values >= threshold take `above`, the others `below` */
    uint8_t below;
    uint8_t above;
    uint16_t unused;
} ls_entry;

#define LS_MAX_BLOCK 4096

/* codes[i] and absmax[block] of x[0:n], exactly as bitsandbytes' quantize_cpu(code, x, absmax, codes, blocksize, n) */
void ls_quantize(const float *x, int64_t n, int64_t blocksize, const ls_entry *table, float *absmax,
                 uint8_t *codes) {
    float v[LS_MAX_BLOCK];
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
        for (i = 0; i < len; i++) v[i] = xb[i] / m;
        memcpy(bits, v, (size_t)len * sizeof(float));
        uint8_t *out = codes + start;
        for (i = 0; i < len; i++) {
            const ls_entry e = table[bits[i] >> 16];
            out[i] = v[i] >= e.threshold ? e.above : e.below; /* NaN compares false: `below` */
        }
    }
}

/* x[i] = code[codes[i]] * absmax[block], exactly as bitsandbytes' dequantize_blockwise_cpu_fp32 */
void ls_dequantize(const float *code, const uint8_t *codes, const float *absmax, float *out, int64_t n,
                   int64_t blocksize) {
    for (int64_t start = 0; start < n; start += blocksize) {
        const int64_t len = (n - start < blocksize) ? n - start : blocksize;
        const float scale = absmax[start / blocksize];
        const uint8_t *cb = codes + start;
        float *ob = out + start;
        for (int64_t i = 0; i < len; i++) ob[i] = code[cb[i]] * scale;
    }
}
