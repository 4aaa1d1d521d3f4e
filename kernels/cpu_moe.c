/* The CPU's mixture-of-experts experts in one call a layer (kernels/cpu_moe.py
 * builds and loads this file).
 *
 * A decode step reaches many small experts with a few rows each. Through
 * torch every expert costs a handful of dispatched ops and two oneDNN calls,
 * each forking and joining the thread team for a product of a few rows, so
 * the calls, not the bytes, set a layer's time. Here the team forks once a
 * layer and shares the step's work in two phases:
 *
 *   1. per expert and panel of 32 intermediate features: the gate and up
 *      products of the expert's rows, act = silu(gate) * up;
 *   2. per expert and panel of 64 hidden features: the down products of the
 *      activations, times each pair's routing weight.
 *
 * The weights come in panels (kernels/cpu_moe.py lays them out): a panel is
 * [K, 64] and contiguous, 64 outputs for each of the K inputs (gate/up: 32
 * gate outputs then their 32 up outputs). A pass over a panel takes up to
 * ROWS rows: for each input, each row's value times the 64 weights is added
 * into 64 sums a row held in registers. So no sum crosses vector lanes and
 * every weight loaded feeds ROWS products; the inputs go in blocks small
 * enough to stay in L2 while every group of rows passes, so an expert reads
 * its panels from memory once however many rows it has.
 *
 * The caller sorts the (token, slot) pairs by expert: pair p's token is
 * tok[p], expert e's pairs are starts[e] .. starts[e + 1]. x is float32;
 * weights and ys are float32 or bfloat16 (sums in float32 either way). ys is
 * [pairs, H], each pair's weighted down projection, which the caller adds up
 * per token in the reference's order. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The register tile of a pass: ROWS rows by VECS vectors of LANES sums,
 * with the VECS weight vectors beside them, fits the vector registers:
 * 24 + 4 of AVX-512's 32, 12 + 4 of AVX2's 16. A panel's PANEL columns take
 * PANEL / (VECS * LANES) passes: one with AVX-512, two with AVX2, each
 * reading two adjacent cache lines of every input's 256 bytes. */
#if defined(__AVX512F__)
enum { LANES = 16, VECS = 4, ROWS = 6 };
#else
enum { LANES = 8, VECS = 4, ROWS = 3 };
#endif
enum { PANEL = 64, HALF = PANEL / 2, CHUNK = VECS * LANES, KBLOCK = 256 };
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t u16s __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t u32s __attribute__((vector_size(LANES * sizeof(uint32_t))));

typedef struct {
    int64_t expert, lo, hi; /* panels lo .. hi */
} Item;

typedef struct {
    const float *x;
    const void *w13, *w2; /* [E, ceil(N / HALF), H, PANEL], [E, ceil(H / PANEL), N, PANEL] */
    const int64_t *tok, *starts;
    const float *pair_weight;
    float *act; /* [pairs, N] */
    void *ys;   /* [pairs, H] */
    int64_t H, N;
    int bf16, ys_bf16; /* the weights', ys's */
    /* fluidserve_moe_routed's sum: out[t] = the sum of token t's pairs' ys
     * (float32), its k slots in increasing expert id. */
    const int64_t *ids, *slot_pair; /* [T, k]: each slot's expert, its pair */
    int64_t T, k;
    void *out; /* [T, H] in the weights' type (no sums where NULL) */
} Layer;

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 weights from element `at`, widened from bfloat16 when the layer's are. */
static inline vec load_weights(int bf16, const void *w, int64_t at) {
    if (!bf16) return load((const float *)w + at);
    u16s v;
    memcpy(&v, (const uint16_t *)w + at, sizeof v);
    u32s bits = __builtin_convertvector(v, u32s) << 16;
    vec f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* sums[r][c] (+)= sum_k rows[r][k] * panel[k][c] for r < nr, c < PANEL:
 * added to what sums holds where `more`, else written. */
static inline __attribute__((always_inline)) void panel_pass(int bf16, const void *panel, int64_t K,
                                                             const float *const *rows, int nr, float (*sums)[PANEL],
                                                             int more) {
    for (int c0 = 0; c0 < PANEL; c0 += CHUNK) {
        vec acc[ROWS][VECS];
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VECS; c++)
                if (more && r < nr)
                    acc[r][c] = load(&sums[r][c0 + c * LANES]);
                else
                    acc[r][c] = (vec){0};
        for (int64_t k = 0; k < K; k++) {
            vec w[VECS];
            for (int c = 0; c < VECS; c++) w[c] = load_weights(bf16, panel, k * PANEL + c0 + c * LANES);
            for (int r = 0; r < nr; r++) {
                float a = rows[r][k];
                for (int c = 0; c < VECS; c++) acc[r][c] += a * w[c];
            }
        }
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < VECS; c++) memcpy(&sums[r][c0 + c * LANES], &acc[r][c], sizeof(vec));
    }
}

/* panel_pass with nr and the weights' type constants in each copy the
 * compiler makes. */
static void panel_rows(int bf16, const void *panel, int64_t K, const float *const *rows, int nr,
                       float (*sums)[PANEL], int more) {
#define PASS(n)                                                                                                        \
    case n:                                                                                                            \
        if (bf16)                                                                                                      \
            panel_pass(1, panel, K, rows, n, sums, more);                                                              \
        else                                                                                                           \
            panel_pass(0, panel, K, rows, n, sums, more);                                                              \
        break;
    switch (nr) {
#if defined(__AVX512F__) /* ROWS 6 */
        PASS(6)
        PASS(5)
        PASS(4)
#endif
        PASS(3)
        PASS(2)
        PASS(1)
    }
#undef PASS
}

/* Panel `index` of a [.., K, PANEL] stack, from input k0 on. */
static inline const void *panel_at(const Layer *L, const void *w, int64_t index, int64_t K, int64_t k0) {
    return (const char *)w + (index * K + k0) * PANEL * (L->bf16 ? sizeof(uint16_t) : sizeof(float));
}

/* sums[q][c] = sum_k src_q[k] * panel[k][c] for the expert's rows q (first ..
 * last; src_q is x's row of the pair's token, or its activations), ROWS
 * rows a pass. The inputs go in blocks of KBLOCK, so that a block of the
 * panel (64 KiB of float32) stays in L2 while every row block passes over
 * it: a prefill's expert of hundreds of rows reads its panels from memory
 * once, whatever K. */
static void expert_panel(const Layer *L, const void *panel, int64_t K, int64_t first, int64_t last, int gate,
                         float (*sums)[PANEL]) {
    for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
        const int64_t kn = K - k0 < KBLOCK ? K - k0 : KBLOCK;
        for (int64_t p = first; p < last; p += ROWS) {
            int nr = last - p < ROWS ? (int)(last - p) : ROWS;
            const float *rows[ROWS];
            for (int r = 0; r < nr; r++) rows[r] = (gate ? L->x + L->tok[p + r] * K : L->act + (p + r) * K) + k0;
            panel_rows(L->bf16, panel_at(L, panel, 0, K, k0), kn, rows, nr, sums + (p - first), k0 > 0);
        }
    }
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* One item of a phase, sums the thread's room for its expert's rows.
 * gate/up: act[p, f] = silu(gate) * up for the features f of the item's
 * panels (32 a panel). down: ys[p, h] = pair_weight[p] * sum_i act[p, i]
 * w2[e, h, i] for its outputs h (64 a panel). */
static void work(const Layer *L, const Item *it, int gate, float (*sums)[PANEL]) {
    const int64_t K = gate ? L->H : L->N, outs = gate ? L->N : L->H, step = gate ? HALF : PANEL;
    const int64_t e = it->expert, panels = (outs + step - 1) / step;
    const int64_t first = L->starts[e], last = L->starts[e + 1];
    for (int64_t j = it->lo; j < it->hi; j++) {
        const int64_t width = outs - j * step < step ? outs - j * step : step, at = j * step;
        expert_panel(L, panel_at(L, gate ? L->w13 : L->w2, e * panels + j, K, 0), K, first, last, gate, sums);
        for (int64_t p = first; p < last; p++) {
            const float *s = sums[p - first];
            const float weight = L->pair_weight[p];
            if (gate)
                for (int64_t f = 0; f < width; f++) L->act[p * L->N + at + f] = silu(s[f]) * s[HALF + f];
            else if (L->ys_bf16)
                for (int64_t h = 0; h < width; h++) ((uint16_t *)L->ys)[p * L->H + at + h] = f32_to_bf16(s[h] * weight);
            else
                for (int64_t h = 0; h < width; h++) ((float *)L->ys)[p * L->H + at + h] = s[h] * weight;
        }
    }
}

/* Each phase's items: every expert with rows, its panels cut into at most
 * `pieces` runs, the experts with most rows first. */
static int64_t plan(Item *items, const int64_t *order, int64_t experts, int64_t panels, int64_t pieces) {
    int64_t count = 0;
    pieces = pieces < panels ? pieces : panels;
    for (int64_t k = 0; k < experts; k++)
        for (int64_t s = 0; s < pieces; s++)
            items[count++] = (Item){order[k], panels * s / pieces, panels * (s + 1) / pieces};
    return count;
}

/* out[t] for the tokens of one thread's share. */
static void sum_tokens(const Layer *L, int64_t t) {
    const int64_t H = L->H, k = L->k;
    int64_t slots[k];
    for (int64_t j = 0; j < k; j++) { /* in increasing expert id, as the reference adds them */
        int64_t at = j;
        while (at > 0 && L->ids[t * k + slots[at - 1]] > L->ids[t * k + j]) slots[at] = slots[at - 1], at--;
        slots[at] = j;
    }
    for (int64_t h0 = 0; h0 < H; h0 += PANEL) {
        float sum[PANEL] = {0};
        const int64_t width = H - h0 < PANEL ? H - h0 : PANEL;
        for (int64_t j = 0; j < k; j++) {
            const float *y = (const float *)L->ys + L->slot_pair[t * k + slots[j]] * H + h0;
            for (int64_t h = 0; h < width; h++) sum[h] += y[h];
        }
        if (L->bf16)
            for (int64_t h = 0; h < width; h++) ((uint16_t *)L->out)[t * H + h0 + h] = f32_to_bf16(sum[h]);
        else
            memcpy((float *)L->out + t * H + h0, sum, sizeof(float) * width);
    }
}

/* The two phases over the experts in `order` (those with rows, most rows
 * first), then the tokens' sums where L->out is set. Returns 0, or -1 when
 * out of memory (nothing written then). */
static int run_layer(Layer *L, const int64_t *order, int64_t experts, int64_t pairs, int threads) {
    if (threads < 1) threads = 1;
    const int64_t H = L->H, N = L->N;
    /* Four runs of panels an expert a thread even out uneven experts; a
     * run is at least one panel, well above the cost of claiming it. */
    const int64_t pieces = 4 * (int64_t)threads;
    const int64_t gate_panels = (N + HALF - 1) / HALF, down_panels = (H + PANEL - 1) / PANEL;
    Item *gate_items = malloc(sizeof(Item) * experts * (gate_panels < pieces ? gate_panels : pieces));
    Item *down_items = malloc(sizeof(Item) * experts * (down_panels < pieces ? down_panels : pieces));
    L->act = malloc(sizeof(float) * (pairs > 0 ? pairs : 1) * N);
    int64_t most = 1; /* the most rows an expert has */
    for (int64_t i = 0; i < experts; i++) {
        const int64_t rows = L->starts[order[i] + 1] - L->starts[order[i]];
        most = rows > most ? rows : most;
    }
    float *room = malloc(sizeof(float) * PANEL * most * threads);
    int status = -1;
    if (gate_items && down_items && L->act && room) {
        const int64_t gates = plan(gate_items, order, experts, gate_panels, pieces);
        const int64_t downs = plan(down_items, order, experts, down_panels, pieces);
        const int64_t tokens = L->out ? L->T : 0;
        /* Linked against the OpenMP runtime torch has loaded, this is the
         * team torch's own ops run on: no second pool of threads. */
#pragma omp parallel num_threads(threads)
        {
            float (*sums)[PANEL] = (float (*)[PANEL])(room + PANEL * most * omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < gates; i++) work(L, &gate_items[i], 1, sums);
            /* (each loop's barrier: what the next reads is written) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < downs; i++) work(L, &down_items[i], 0, sums);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tokens; t++) sum_tokens(L, t);
        }
        status = 0;
    }
    free(gate_items), free(down_items), free(L->act), free(room);
    return status;
}

/* The pairs sorted by expert by the caller (kernels/cpu_moe.py, whose
 * oneDNN path takes the experts left out of `order`): ys in the weights'
 * type. Returns 0, or -1 when out of memory (nothing written then). */
int fluidserve_moe(const float *x, const void *w13, const void *w2, const int64_t *tok, const int64_t *starts,
                   const float *pair_weight, const int64_t *order, int64_t experts, int64_t pairs, int64_t H,
                   int64_t N, int bf16, int threads, void *ys) {
    Layer L = {.x = x, .w13 = w13, .w2 = w2, .tok = tok, .starts = starts, .pair_weight = pair_weight,
               .ys = ys, .H = H, .N = N, .bf16 = bf16, .ys_bf16 = bf16};
    return run_layer(&L, order, experts, pairs, threads);
}

static int ascending(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The whole layer from the router's choice: ids and weights [T, k], out
 * [T, H] in the weights' type. Returns 0 when done; 1 when an expert has
 * more than native_rows rows, for the caller's path that sends those to
 * oneDNN; -1 when out of memory; -2 for an id outside [0, E) (nothing
 * written but 0). */
int fluidserve_moe_routed(const float *x, const void *w13, const void *w2, const int64_t *ids, const float *weights,
                          int64_t T, int64_t k, int64_t E, int64_t H, int64_t N, int bf16, int threads,
                          int64_t native_rows, void *out) {
    const int64_t pairs = T * k;
    int64_t *counts = calloc(E + 1, sizeof(int64_t)), *starts = malloc(sizeof(int64_t) * (E + 1));
    int64_t *tok = malloc(sizeof(int64_t) * (pairs + 1)), *slot_pair = malloc(sizeof(int64_t) * (pairs + 1));
    int64_t *order = malloc(sizeof(int64_t) * E);
    float *pair_weight = malloc(sizeof(float) * (pairs + 1)), *ys = malloc(sizeof(float) * (pairs + 1) * H);
    int status = -1;
    if (!counts || !starts || !tok || !slot_pair || !order || !pair_weight || !ys) goto done;
    status = -2;
    for (int64_t i = 0; i < pairs; i++) {
        if (ids[i] < 0 || ids[i] >= E) goto done;
        counts[ids[i]]++;
    }
    /* The experts with rows, most rows first, then by id: sorted as keys
     * (native_rows - rows) * E + id. */
    int64_t experts = 0;
    status = 1;
    for (int64_t e = 0; e < E; e++) {
        if (counts[e] > native_rows) goto done;
        if (counts[e]) order[experts++] = (native_rows - counts[e]) * E + e;
    }
    qsort(order, experts, sizeof(int64_t), ascending);
    for (int64_t i = 0; i < experts; i++) order[i] %= E;
    /* Pair j * T + t in that order within its expert: the order of the
     * reference's rows (slot, then token). */
    starts[0] = 0;
    for (int64_t e = 0; e < E; e++) starts[e + 1] = starts[e] + counts[e];
    memcpy(counts, starts, sizeof(int64_t) * E); /* now each expert's next free pair */
    for (int64_t j = 0; j < k; j++)
        for (int64_t t = 0; t < T; t++) {
            int64_t p = counts[ids[t * k + j]]++;
            tok[p] = t, pair_weight[p] = weights[t * k + j], slot_pair[t * k + j] = p;
        }
    Layer L = {.x = x, .w13 = w13, .w2 = w2, .tok = tok, .starts = starts, .pair_weight = pair_weight,
               .ys = ys, .H = H, .N = N, .bf16 = bf16, .ys_bf16 = 0,
               .ids = ids, .slot_pair = slot_pair, .T = T, .k = k, .out = out};
    status = run_layer(&L, order, experts, pairs, threads);
done:
    free(counts), free(starts), free(tok), free(slot_pair), free(order), free(pair_weight), free(ys);
    return status;
}
