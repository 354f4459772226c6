/* vLLM Model Runner V2's PCP layout with sharded decodes (DCP 1), in one pass over the batch.
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
 * after the engine's own work; one loop here writes each output once (docs/vllm.md).
 *
 * Plain C, no Python headers: loaded with ctypes (runner_fsm/pcp/native.py). The caller
 * checks its inputs (lengths >= 0, P >= 1) and passes output capacities; N and T are worked
 * out here, and every run is checked against its rank's rows and T before it is written, so
 * that nothing is ever written outside the outputs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MRV2_LAYOUT_ABI 3
#define MRV2_PADDING_TOO_SMALL (-1)
#define MRV2_NEEDS_SPACE (-2)
#define MRV2_BROKEN_PROMISE (-3)

int64_t mrv2_layout_abi(void) { return MRV2_LAYOUT_ABI; }

static int64_t clamp(int64_t v, int64_t hi) { return v < 0 ? 0 : v > hi ? hi : v; }

/* rows[r] = rows of rank r (r < P), rows[P] = tokens T; returns the widest rank's rows. */
static int64_t rows_per_rank(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                             int64_t pcp, int64_t *rows) {
    int64_t dealt = 0, chunks = 2 * pcp, widest = 0, total = 0;
    memset(rows, 0, (size_t)pcp * sizeof(int64_t));
    for (int64_t i = 0; i < num_reqs; i++) {
        int64_t len = lengths[i];
        total += len;
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

/* The dispatch count N (the widest rank's rows), or -1 when memory for P > 256 ranks is short. */
int64_t mrv2_dispatch_count(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                            int64_t pcp) {
    int64_t on_stack[257];
    int64_t *rows = pcp <= 256 ? on_stack : malloc((size_t)(pcp + 1) * sizeof(int64_t));
    if (rows == NULL) return -1;
    int64_t widest = rows_per_rank(lengths, prefilling, num_reqs, pcp, rows);
    if (rows != on_stack) free(rows);
    return widest;
}

/* Tokens first..first+len-1 go to gathered rows row..row+len-1, and back; 0, or -1 (nothing
 * written) when the run would pass the end of its rank's rows or of the tokens. */
static int put_run(int64_t *gathered, uint8_t *mask, int64_t *restore, int64_t row, int64_t row_end,
                   int64_t first, int64_t len, int64_t total) {
    if (len == 0) return 0;  /* an empty chunk: its offset may lie past its request */
    if (row + len > row_end || first + len > total) return -1;
    int64_t *g = gathered + row, *back = restore + first;
    for (int64_t j = 0; j < len; j++) {
        g[j] = first + j;
        back[j] = row + j;
    }
    memset(mask + row, 1, (size_t)len);
    return 0;
}

/* gathered[P*N] (token of each row, 0 on padding), mask[P*N] (1 on rows, 0 on padding),
 * restore[T] (gathered row of each token); cursor[P] is scratch. */
static int64_t write_layout(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs,
                            int64_t pcp, int64_t padded, int64_t total, int64_t *gathered,
                            uint8_t *mask, int64_t *restore, int64_t *cursor) {
    int64_t chunks = 2 * pcp, dealt = 0, first = 0;
    for (int64_t r = 0; r < pcp; r++) cursor[r] = r * padded;
    for (int64_t i = 0; i < num_reqs; first += lengths[i], i++) {  /* decodes, dealt out */
        int64_t len = lengths[i];
        if (prefilling[i] || len == 0) continue;
        int64_t r = dealt++ % pcp;
        if (put_run(gathered, mask, restore, cursor[r], (r + 1) * padded, first, len, total))
            return MRV2_BROKEN_PROMISE;
        cursor[r] += len;
    }
    first = 0;
    for (int64_t i = 0; i < num_reqs; first += lengths[i], i++) {  /* prefills: head, tail */
        int64_t len = lengths[i];
        if (!prefilling[i]) continue;
        int64_t width = (len + chunks - 1) / chunks;
        for (int64_t r = 0; r < pcp; r++) {
            int64_t head = r * width, tail = (chunks - 1 - r) * width, row_end = (r + 1) * padded;
            int64_t head_len = clamp(len - head, width), tail_len = clamp(len - tail, width);
            if (put_run(gathered, mask, restore, cursor[r], row_end, first + head, head_len, total))
                return MRV2_BROKEN_PROMISE;
            cursor[r] += head_len;
            if (put_run(gathered, mask, restore, cursor[r], row_end, first + tail, tail_len, total))
                return MRV2_BROKEN_PROMISE;
            cursor[r] += tail_len;
        }
    }
    for (int64_t r = 0; r < pcp; r++) {  /* padding */
        int64_t end = (r + 1) * padded;
        memset(gathered + cursor[r], 0, (size_t)(end - cursor[r]) * sizeof(int64_t));
        memset(mask + cursor[r], 0, (size_t)(end - cursor[r]));
    }
    return 0;
}

/* One step's plan, in one call. scratch[2P + 1]: rows of each rank, then T, then cursors.
 * N = `padded`, or the widest rank's rows when `padded` < 0. The outputs go to ints (gathered
 * [P*N], then restore [T]) and bools (mask [P*N]). Returns N when written;
 * MRV2_PADDING_TOO_SMALL when 0 <= padded < the widest rank's rows; MRV2_NEEDS_SPACE when
 * P*N + T > ints_cap or P*N > bools_cap (nothing written but scratch: the caller grows its
 * buffers and calls again). */
int64_t mrv2_plan(const int64_t *lengths, const uint8_t *prefilling, int64_t num_reqs, int64_t pcp,
                  int64_t padded, int64_t *ints, int64_t ints_cap, uint8_t *bools, int64_t bools_cap,
                  int64_t *scratch) {
    int64_t widest = rows_per_rank(lengths, prefilling, num_reqs, pcp, scratch);
    int64_t total = scratch[pcp], n = padded < 0 ? widest : padded;
    if (n < widest) return MRV2_PADDING_TOO_SMALL;
    if (pcp * n + total > ints_cap || pcp * n > bools_cap) return MRV2_NEEDS_SPACE;
    int64_t status = write_layout(lengths, prefilling, num_reqs, pcp, n, total, ints, bools,
                                  ints + pcp * n, scratch + pcp + 1);
    return status ? status : n;
}
