/* vLLM Model Runner V2's PCP layout with sharded decodes (DCP 1), each output written once.
 *
 * The same layout as `runner_fsm.pcp.layout.sharded_segments` + `rows.gathered_layout`
 * (tests/test_plan_native.py holds them equal): the k-th decode with tokens goes whole to
 * rank k mod P; prefill i is cut into 2P chunks of ceil(L_i / 2P) tokens (the last ones short
 * or empty) and rank r takes chunk r (head) and chunk 2P-1-r (tail); inside a rank, decodes
 * come first, then prefills, each in request order. No request is replicated, so every
 * token has exactly one gathered row.
 *
 * Why compiled: numpy writes these runs of consecutive integers with a running sum per
 * output plus about a hundred small calls, each of which starts from cold caches right
 * after the engine's own work; here one call writes each output once, front to back: the
 * gathered layout rank by rank, then the restore index in token order. That is one write
 * stream at a time; writing both in request order (P + 1 streams at once) cost 1.6x at P=4
 * and 2.1x at P=8 right after vLLM's own layout call (docs/vllm.md). `mrv2_rank_segments`
 * lists one rank's segments, for a caller (vLLM's PCP manager) that needs only its own.
 *
 * Plain C, no Python headers: loaded with ctypes (runner_fsm/pcp/native.py), built by the
 * package's build (setup.py, an optional extension) or by `make` in a checkout. Both define
 * MRV2_SOURCE_DIGEST, the start of this file's sha256, and the loader loads a library only
 * when that is the digest of the source shipped beside it.
 *
 * Nothing the caller passes is trusted: P, the request count, every length and every
 * capacity is checked before anything is written, the sizes worked out from them (T,
 * P*N + T) are computed with overflow checks and bounded by MRV2_MAX_SIZE, and every run is
 * checked against its rank's rows and T before it is written. The caller (native.py) checks
 * its scalars first as well, since ctypes truncates a Python int that does not fit silently.
 * The limits leave int64 headroom: with T and P*N + T at most 2^62 and P at most 2^16, no
 * sum or product below can overflow.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MRV2_SOURCE_DIGEST
#error "define MRV2_SOURCE_DIGEST as the first 16 hex digits of this file's sha256 (setup.py and the Makefile do)"
#endif

#define MRV2_PADDING_TOO_SMALL (-1)
#define MRV2_NEEDS_SPACE (-2)
#define MRV2_BROKEN_PROMISE (-3)
#define MRV2_BAD_ARGUMENT (-4) /* P out of [1, MRV2_MAX_PCP], a count, length or capacity < 0 */
#define MRV2_TOO_LARGE (-5)    /* T or P*N + T beyond MRV2_MAX_SIZE */
#define MRV2_NO_MEMORY (-6)
#define MRV2_MAX_PCP ((int64_t)1 << 16)
#define MRV2_MAX_SIZE ((int64_t)1 << 62)

const char *mrv2_layout_source_digest(void) { return MRV2_SOURCE_DIGEST; }

static int64_t clamp(int64_t v, int64_t hi) { return v < 0 ? 0 : v > hi ? hi : v; }

static int bad_batch(int64_t num_reqs, int64_t pcp) {
    return num_reqs < 0 || pcp < 1 || pcp > MRV2_MAX_PCP;
}

/* rows[r] = rows of rank r (r < P), rows[P] = tokens T; returns the widest rank's rows, or
 * MRV2_BAD_ARGUMENT for a length < 0, MRV2_TOO_LARGE when T passes MRV2_MAX_SIZE. Each rank's
 * rows are at most T (no request is replicated), so they cannot overflow either. */
static int64_t rows_per_rank(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                             int64_t pcp, int64_t *rows) {
    int64_t dealt = 0, chunks = 2 * pcp, widest = 0, total = 0;
    memset(rows, 0, (size_t)pcp * sizeof(int64_t));
    for (int64_t i = 0; i < num_reqs; i++) {
        int64_t len = lengths[i];
        if (len < 0) return MRV2_BAD_ARGUMENT;
        if (__builtin_add_overflow(total, len, &total) || total > MRV2_MAX_SIZE) return MRV2_TOO_LARGE;
        if (!prefilling[i]) {
            if (len > 0) rows[dealt++ % pcp] += len;
            continue;
        }
        int64_t width = (len + chunks - 1) / chunks;
        for (int64_t r = 0; r < pcp; r++)
            rows[r] += clamp(len - r * width, width) + clamp(len - (chunks - 1 - r) * width, width);
    }
    rows[pcp] = total;
    for (int64_t r = 0; r < pcp; r++)
        if (rows[r] > widest) widest = rows[r];
    return widest;
}

/* The dispatch count N (the widest rank's rows), or a negative MRV2_ answer. */
int64_t mrv2_dispatch_count(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                            int64_t pcp) {
    if (bad_batch(num_reqs, pcp)) return MRV2_BAD_ARGUMENT;
    int64_t on_stack[257];
    int64_t *rows = pcp <= 256 ? on_stack : malloc((size_t)(pcp + 1) * sizeof(int64_t));
    if (rows == NULL) return MRV2_NO_MEMORY;
    int64_t widest = rows_per_rank(lengths, prefilling, num_reqs, pcp, rows);
    if (rows != on_stack) free(rows);
    return widest;
}

/* gathered[P*N] (token of each row, 0 on padding), mask[P*N] (1 on rows, 0 on padding),
 * restore[T] (gathered row of each token); cursor[2P] is scratch. Two passes, each writing
 * one output front to back: the gathered layout rank by rank, then the restore index in
 * token order (one stream each, instead of P + 1 streams interleaved). */
static int64_t write_layout(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                            int64_t pcp, int64_t padded, int64_t total, int64_t *gathered,
                            uint8_t *mask, int64_t *restore, int64_t *cursor) {
    int64_t chunks = 2 * pcp;
    int64_t *decode_cursor = cursor, *prefill_cursor = cursor + pcp;
    for (int64_t r = 0; r < pcp; r++) {  /* pass 1: rank r's rows, in its order */
        int64_t row = r * padded, row_end = row + padded, dealt = 0, first = 0;
        for (int64_t i = 0; i < num_reqs; first += lengths[i], i++) {
            int64_t len = lengths[i];
            if (prefilling[i] || len == 0) continue;
            if (dealt++ % pcp != r) continue;
            if (row + len > row_end || first + len > total) return MRV2_BROKEN_PROMISE;
            for (int64_t j = 0; j < len; j++) gathered[row + j] = first + j;
            row += len;
        }
        prefill_cursor[r] = row;  /* where rank r's prefill rows begin */
        first = 0;
        for (int64_t i = 0; i < num_reqs; first += lengths[i], i++) {
            int64_t len = lengths[i];
            if (!prefilling[i]) continue;
            int64_t width = (len + chunks - 1) / chunks;
            int64_t head = r * width, tail = (chunks - 1 - r) * width;
            int64_t head_len = clamp(len - head, width), tail_len = clamp(len - tail, width);
            if (row + head_len + tail_len > row_end || first + len > total) return MRV2_BROKEN_PROMISE;
            for (int64_t j = 0; j < head_len; j++) gathered[row + j] = first + head + j;
            row += head_len;
            for (int64_t j = 0; j < tail_len; j++) gathered[row + j] = first + tail + j;
            row += tail_len;
        }
        memset(mask + r * padded, 1, (size_t)(row - r * padded));
        memset(mask + row, 0, (size_t)(row_end - row));
        memset(gathered + row, 0, (size_t)(row_end - row) * sizeof(int64_t));
    }
    for (int64_t r = 0; r < pcp; r++) decode_cursor[r] = r * padded;
    int64_t dealt = 0, first = 0;
    for (int64_t i = 0; i < num_reqs; first += lengths[i], i++) {  /* pass 2: token order */
        int64_t len = lengths[i];
        if (first + len > total) return MRV2_BROKEN_PROMISE;
        if (!prefilling[i]) {
            if (len == 0) continue;
            int64_t r = dealt++ % pcp, row = decode_cursor[r];
            if (row + len > (r + 1) * padded) return MRV2_BROKEN_PROMISE;
            for (int64_t j = 0; j < len; j++) restore[first + j] = row + j;
            decode_cursor[r] += len;
            continue;
        }
        int64_t width = (len + chunks - 1) / chunks;
        for (int64_t c = 0; c < chunks; c++) {  /* chunk c is rank r's head or its tail */
            int64_t r = c < pcp ? c : chunks - 1 - c;
            int64_t offset = c * width, chunk_len = clamp(len - offset, width);
            int64_t row = prefill_cursor[r] + (c < pcp ? 0 : clamp(len - r * width, width));
            for (int64_t j = 0; j < chunk_len; j++) restore[first + offset + j] = row + j;
        }
        for (int64_t r = 0; r < pcp; r++)
            prefill_cursor[r] += clamp(len - r * width, width) + clamp(len - (chunks - 1 - r) * width, width);
    }
    return 0;
}

/* One step's plan, in one call. scratch[3P + 1]: rows of each rank, then T, then 2P cursors.
 * N = `padded`, or the widest rank's rows when `padded` is -1. The outputs go to ints
 * (gathered [P*N], then restore [T]) and bools (mask [P*N]). Returns N when written;
 * MRV2_PADDING_TOO_SMALL when 0 <= padded < the widest rank's rows; MRV2_NEEDS_SPACE when
 * P*N + T > ints_cap or P*N > bools_cap (nothing written but scratch, which then holds T
 * at [P] and N at [P + 1]: the caller grows its buffers and calls again); MRV2_BAD_ARGUMENT
 * and MRV2_TOO_LARGE (nothing written but scratch) for what no buffer could hold. */
int64_t mrv2_plan(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs, int64_t pcp,
                  int64_t padded, int64_t *ints, int64_t ints_cap, uint8_t *bools, int64_t bools_cap,
                  int64_t *scratch, int64_t scratch_cap) {
    if (bad_batch(num_reqs, pcp) || padded < -1 || ints_cap < 0 || bools_cap < 0 || scratch_cap < 3 * pcp + 1)
        return MRV2_BAD_ARGUMENT;
    int64_t widest = rows_per_rank(lengths, prefilling, num_reqs, pcp, scratch);
    if (widest < 0) return widest;
    int64_t total = scratch[pcp], n = padded < 0 ? widest : padded, rows, size;
    if (n < widest) return MRV2_PADDING_TOO_SMALL;
    if (__builtin_mul_overflow(pcp, n, &rows) || __builtin_add_overflow(rows, total, &size) ||
        size > MRV2_MAX_SIZE)
        return MRV2_TOO_LARGE;
    if (size == 0) return n;  /* nothing to write */
    if (size > ints_cap || rows > bools_cap) {
        scratch[pcp + 1] = n;  /* the caller sizes its buffers from N (here) and T (scratch[P]) */
        return MRV2_NEEDS_SPACE;
    }
    int64_t status = write_layout(lengths, prefilling, num_reqs, pcp, n, total, ints, bools,
                                  ints + rows, scratch + pcp + 1);  /* cursor: 2P */
    return status ? status : n;
}

/* Rank `rank`'s segments, in its order (the decodes dealt to it, then each prefill's head and
 * tail chunk, in request order; empty chunks left out), as five columns of `cap` entries in
 * segs: request, first and end global token, first and end row of the rank. Returns how many
 * there are; MRV2_NEEDS_SPACE when more than `cap` (none past the first `cap` written; at most
 * 2 per request); MRV2_BAD_ARGUMENT / MRV2_TOO_LARGE as `mrv2_plan` (nothing written). */
int64_t mrv2_rank_segments(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                           int64_t pcp, int64_t rank, int64_t *segs, int64_t cap) {
    if (bad_batch(num_reqs, pcp) || rank < 0 || rank >= pcp || cap < 0 || cap > MRV2_MAX_SIZE / 5)
        return MRV2_BAD_ARGUMENT;
    int64_t chunks = 2 * pcp, dealt = 0, first = 0, row = 0, count = 0;
    for (int64_t i = 0; i < num_reqs; i++) {  /* every length checked before anything is written */
        if (lengths[i] < 0) return MRV2_BAD_ARGUMENT;
        if (__builtin_add_overflow(first, lengths[i], &first) || first > MRV2_MAX_SIZE) return MRV2_TOO_LARGE;
    }
    int64_t *req = segs, *start = segs + cap, *end = segs + 2 * cap, *local = segs + 3 * cap,
            *local_end = segs + 4 * cap;
#define MRV2_SEGMENT(i, from, len)                                                  \
    do {                                                                            \
        if (count < cap) {                                                          \
            req[count] = (i), start[count] = (from), end[count] = (from) + (len);   \
            local[count] = row, local_end[count] = row + (len);                     \
        }                                                                           \
        count++, row += (len);                                                      \
    } while (0)
    first = 0;
    for (int64_t i = 0; i < num_reqs; first += lengths[i], i++)  /* the decodes dealt to it */
        if (!prefilling[i] && lengths[i] > 0 && dealt++ % pcp == rank) MRV2_SEGMENT(i, first, lengths[i]);
    first = 0;
    for (int64_t i = 0; i < num_reqs; first += lengths[i], i++) {  /* its chunks of each prefill */
        int64_t len = lengths[i];
        if (!prefilling[i] || len == 0) continue;
        int64_t width = (len + chunks - 1) / chunks;
        int64_t head = rank * width, tail = (chunks - 1 - rank) * width;
        int64_t head_len = clamp(len - head, width), tail_len = clamp(len - tail, width);
        if (head_len > 0) MRV2_SEGMENT(i, first + head, head_len);
        if (tail_len > 0) MRV2_SEGMENT(i, first + tail, tail_len);
    }
#undef MRV2_SEGMENT
    return count > cap ? MRV2_NEEDS_SPACE : count;
}

/* 1 when starts[i] is where request i begins (the running sum of the lengths before it) for
 * every i <= R and the last of the `num_starts` entries is T, else 0 (the layout above
 * starts each request there); MRV2_BAD_ARGUMENT for fewer than R + 1 starts or a length < 0.
 * It only reads. */
int64_t mrv2_is_running_sum(const int64_t *lengths, int64_t num_reqs, const int64_t *starts,
                            int64_t num_starts) {
    if (num_reqs < 0 || num_starts <= num_reqs) return MRV2_BAD_ARGUMENT;
    int64_t first = 0;
    for (int64_t i = 0; i < num_reqs; i++) {
        if (lengths[i] < 0) return MRV2_BAD_ARGUMENT;
        if (starts[i] != first || __builtin_add_overflow(first, lengths[i], &first)) return 0;
    }
    return starts[num_reqs] == first && starts[num_starts - 1] == first;
}
