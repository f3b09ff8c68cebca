/* A Python-free harness around the kernels' loops (tests/test_kernels_aarch64.py): builds
 * deterministic inputs from an integer generator, runs every scan and compare entry point of
 * the variant it is compiled as (-DVW, -DKERNEL_VARIANT) and prints every result as bits, so
 * that builds for different CPUs (or run under qemu) can be compared byte for byte. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "scan.c"
#include "compare.c"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {   /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void bits(double v) { uint64_t u; memcpy(&u, &v, 8); printf(" %016" PRIx64, u); }

/* n float32 values: mostly integers times a power of two (exact everywhere), some zeros, tiny
 * and huge values; near base (x·(1 + e), rounded once) when base is given. */
static void values(float *o, ptrdiff_t n, const float *base, int scale) {
    for (ptrdiff_t i = 0; i < n; i++) {
        uint64_t r = next();
        double v = ldexp((double)((int64_t)(r % 2000001) - 1000000), scale - 20);
        if (base) v = (double)base[i] * (1.0 + ldexp((double)((int64_t)(r % 2001) - 1000), -20));
        if (r % 97 == 0) v = 0.0;
        if (r % 101 == 0) v = ldexp(1.0, -100);
        o[i] = (float)v;
    }
}

static void to_kind(const float *f, void *o, ptrdiff_t n, int kind) {   /* words of a kind */
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t u = u_bits(f[i]);
        if (kind == K_F32) ((float *)o)[i] = f[i];
        else if (kind == K_BF16) ((uint16_t *)o)[i] = (uint16_t)(u >> 16);
        else {   /* float16 by truncation, in range: exponent rebiased, overflow to the max */
            int e = (int)((u >> 23) & 0xff) - 127 + 15;
            uint16_t h = e <= 0 ? 0 : e >= 31 ? 0x7bff : (uint16_t)((e << 10) | ((u >> 13) & 0x3ff));
            ((uint16_t *)o)[i] = (uint16_t)(h | ((u >> 16) & 0x8000));
        }
    }
}

static void print_blk(const blk_t *b) {
    printf(" %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64, b->nan, b->pinf, b->ninf,
           b->zeros, b->finite, b->sat);
    bits(b->mn); bits(b->mx); bits(b->s); bits(b->sc); bits(b->q); bits(b->qc); bits(b->a); bits(b->ac);
}

static void print_sums(const Sums *s) {
    const double *d = &s->sx;
    for (int j = 0; j < 20; j++) bits(d[j]);
    printf(" %" PRId64 " %" PRId64 " %" PRId64, s->c1, s->c5, s->differ);
}

int main(void) {
    static const ptrdiff_t LENS[] = {1, 7, 8, 31, 33, 100, 1023, 1025, 4099, 20011};
    const scan_ops *so = &KV(SCAN_OPS);
    const cmp_ops *co = &KV(CMP_OPS);
    float *x = malloc(20011 * 4), *y = malloc(20011 * 4);
    double *d = malloc(20011 * 8);
    char *wx = malloc(20011 * 4), *wy = malloc(20011 * 4);
    for (size_t li = 0; li < sizeof LENS / sizeof *LENS; li++) {
        ptrdiff_t n = LENS[li];
        for (int special = 0; special < 3; special++) {
            values(x, n, NULL, (int)(li % 5) * 3 - 6);
            if (special == 1) x[n / 2] = NAN;
            if (special == 2) x[n - 1] = INFINITY;
            blk_t b;
            printf("scan n=%td special=%d\n", n, special);
            so->f32(x, n, &b); print_blk(&b); printf("\n");
            for (ptrdiff_t i = 0; i < n; i++) d[i] = (double)x[i] * 1.5;
            so->f64(d, n, &b); print_blk(&b); printf("\n");
            to_kind(x, wx, n, K_F16);
            so->f16(wx, n, &b); print_blk(&b); printf("\n");
            to_kind(x, wx, n, K_BF16);
            so->bf16(wx, n, &b); print_blk(&b); printf("\n");
        }
        values(x, n, NULL, (int)(li % 3) * 4 - 4);
        values(y, n, x, 0);
        for (int kx = 0; kx < 3; kx++)
            for (int ky = 0; ky < 3; ky++) {
                Sums s;
                double lo, hi, lo2, hi2;
                to_kind(x, wx, n, kx);
                to_kind(y, wy, n, ky);
                printf("compare n=%td kinds=%d,%d\n", n, kx, ky);
                co->block(0, kx, ky, wx, wy, n, NULL, &s); print_sums(&s); printf("\n");
                printf(" first_at %td", co->first_at(wx, wy, n, kx, ky, s.mad));
                co->range(wx, n, kx, &lo, &hi); co->range(wy, n, ky, &lo2, &hi2);
                bits(lo); bits(hi); bits(lo2); bits(hi2); printf("\n");
                if (!(hi > lo && hi2 > lo2)) continue;
                for (int clamps = 0; clamps < 2; clamps++) {
                    KldP kp = clamps ? (KldP){lo, 1 / (hi - lo), lo2, 1 / (hi2 - lo2)}
                                     : (KldP){lo - (hi - lo), 1 / (2 * (hi - lo)), lo2 - (hi2 - lo2), 1 / (2 * (hi2 - lo2))};
                    co->block(clamps ? 1 : 2, kx, ky, wx, wy, n, &kp, &s); print_sums(&s); printf("\n");
                    co->terms(clamps, kx, ky, wx, wy, n, &kp, &s); print_sums(&s); printf("\n");
                }
                if (kx == ky) {
                    double sa = 0, sq = 0;
                    int eq = co->same(wx, wx, n, kx, &sa, &sq);
                    printf(" same %d", eq); bits(sa); bits(sq); printf("\n");
                }
            }
    }
    free(x); free(y); free(d); free(wx); free(wy);
    return 0;
}
