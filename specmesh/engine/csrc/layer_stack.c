
#include <stdint.h>
#include <string.h>

typedef int (*mm4_fn)(const uint16_t*, int64_t, int64_t, const void*, int64_t, int64_t, float*, uint16_t*);
typedef int (*mm16_fn)(const uint16_t*, int64_t, int64_t, const void*, int64_t, uint16_t*);
typedef int (*attn_fn)(const void*, const uint16_t*, uint16_t*, uint16_t*, uint16_t*);
typedef void (*rms_fn)(float*, const uint16_t*, const float*, uint16_t*, int64_t, int64_t, float);
typedef void (*silu_fn)(const uint16_t*, uint16_t*, int64_t, int64_t);

typedef struct {
    const void *qkv, *o, *gu, *down;           /* packed weights (int4_matmul.pack / bf16_matmul.pack) */
    const uint16_t *bqkv, *bo, *bgu, *bdown;   /* bf16 biases, or NULL */
    const float *ln1, *ln2;                    /* fp32 RMSNorm weights */
} layer_w;

typedef struct {
    void *mm, *attn, *rms, *silu;              /* the kernels' entry points */
    int64_t kind;                              /* mm: 0 int4_mm (takes group, xs), 1 bf16_mm, 2 qmm_bf16 (xs: its int8 rows) */
    int64_t H, I, qkv_row, attn_w, group, n_layers, layer_bytes;
    const layer_w* layers;
    char *k0, *v0;                             /* layer 0 of the K / V cache */
    float eps;
} stack_def;

static inline float bf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* y [N, W] bf16 += b [W] bf16: the sum in fp32, rounded to nearest even (NaN stays NaN) */
static void add_bias(uint16_t* y, const uint16_t* b, int64_t N, int64_t W) {
    if (!b) return;
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < W; j++) {
            float f = bf(y[n * W + j]) + bf(b[j]); uint32_t u; memcpy(&u, &f, 4);
            y[n * W + j] = (f != f) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
}

static inline int mm(const stack_def* S, const uint16_t* x, int64_t N, int64_t K, const void* w, int64_t n,
                     float* xs, uint16_t* y) {
    return S->kind != 1 ? ((mm4_fn)S->mm)(x, N, K, w, n, S->group, xs, y) : ((mm16_fn)S->mm)(x, N, K, w, n, y);
}

/* layers [l0, l1) on the fp32 residual stream x [N, H] (in place). ws: bf16 workspace of
   N * (3 H + qkv_row + attn_w + 3 I) elements; xs: fp32 scratch of N * max(H, attn_w, I) / group
   (kind 2: qmm_scratch_bytes(N, max(H, attn_w, I)) bytes). 0: done; 1: a matmul refused; 2:
   attention ran out of memory. */
int stack_run(const stack_def* S, const void* plan, int64_t l0, int64_t l1, int64_t N, float* x,
              uint16_t* ws, float* xs) {
    const attn_fn attn = (attn_fn)S->attn;
    const rms_fn rms = (rms_fn)S->rms; const silu_fn silu = (silu_fn)S->silu;
    const int64_t H = S->H, I = S->I, R = S->qkv_row, A = S->attn_w;
    uint16_t *h = ws, *qkv = h + N * H, *a = qkv + N * R, *o = a + N * A, *gu = o + N * H, *m = gu + N * 2 * I,
             *d = m + N * I;
    const uint16_t* pending = NULL;
    for (int64_t li = l0; li < l1; li++) {
        const layer_w* L = S->layers + li;
        rms(x, pending, L->ln1, h, N, H, S->eps);
        if (mm(S, h, N, H, L->qkv, R, xs, qkv)) return 1;
        add_bias(qkv, L->bqkv, N, R);
        if (attn(plan, qkv, (uint16_t*)(S->k0 + li * S->layer_bytes), (uint16_t*)(S->v0 + li * S->layer_bytes), a))
            return 2;
        if (mm(S, a, N, A, L->o, H, xs, o)) return 1;
        add_bias(o, L->bo, N, H);
        rms(x, o, L->ln2, h, N, H, S->eps);
        if (mm(S, h, N, H, L->gu, 2 * I, xs, gu)) return 1;
        add_bias(gu, L->bgu, N, 2 * I);
        silu(gu, m, N, I);
        if (mm(S, m, N, I, L->down, H, xs, d)) return 1;
        add_bias(d, L->bdown, N, H);
        pending = d;
    }
    if (pending)
        for (int64_t i = 0; i < N * H; i++) x[i] += bf(pending[i]);
    return 0;
}
