/* Strided views of a 2-D array in device memory. A ROWS x COLS matrix of
 * int32 lives in a context buffer; a view of one column (one dimension, a
 * stride of a whole row) and a transposed view (shape and strides swapped)
 * are made over it with cubuf_context_buffer_from_strided, with the buffer
 * as their base. A view covers the contiguous span its elements touch, gaps
 * included, so host copies address an element by its byte offset in that
 * span: the column is rewritten element by element through its view, and
 * the transposed view reads everything back. While the views are open the
 * buffer cannot be closed (CUBUF_ERROR_BUSY): they depend on it.
 * Build: part of the cubuf build (example_strided). Run: ./build/examples/example_strided */
#include <cubuf.h>
#include <stdio.h>

#define ROWS 64
#define COLS 48
#define COL 5 /* the column rewritten through its view */
#define ITEM 4 /* bytes of an element, sizeof(int32_t) */

#define TRY(expr)                                                                            \
    do {                                                                                     \
        if ((st = (expr)) != CUBUF_SUCCESS) {                                                \
            fprintf(stderr, "%s: %s: %s\n", #expr, cubuf_status_name(st), cubuf_last_error()); \
            goto done;                                                                       \
        }                                                                                    \
    } while (0)

static int32_t matrix[ROWS][COLS], transposed[COLS][ROWS];

int main(void)
{
    int count = 0, rc = 1;
    cubuf_status_t st = cubuf_device_count(&count);
    if (st != CUBUF_SUCCESS || count == 0) {
        printf("SKIP: needs 1 CUDA device(s): %s\n", /* the tests' words */
               st != CUBUF_SUCCESS ? cubuf_last_error() : "not enough devices");
        return 77;
    }
    cubuf_context_t *ctx = NULL;
    cubuf_buffer_t *buf = NULL, *column = NULL, *trans = NULL;
    int32_t span[ROWS * COLS];
    size_t n = 0;
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) matrix[r][c] = r * 1000 + c;

    TRY(cubuf_context_create(0, &ctx));
    TRY(cubuf_context_new_buffer(ctx, sizeof matrix, &buf));
    TRY(cubuf_buffer_copy_from_host(buf, matrix, sizeof matrix, 0, -1, 0, NULL));
    CUdeviceptr a = cubuf_buffer_ptr(buf);

    /* Column COL: ROWS elements, a row apart, starting at element [0][COL]. */
    const int64_t col_shape[1] = {ROWS}, col_strides[1] = {COLS * ITEM};
    TRY(cubuf_context_buffer_from_strided(ctx, a + COL * ITEM, 1, col_shape, col_strides, ITEM,
                                          buf, NULL, NULL, &column));
    printf("column view: %zu bytes at offset %llu of the buffer\n", cubuf_buffer_size(column),
           (unsigned long long)(cubuf_buffer_ptr(column) - a));
    if (cubuf_buffer_size(column) != (size_t)((ROWS - 1) * COLS * ITEM + ITEM)) {
        fprintf(stderr, "the column view should span %d bytes\n", (ROWS - 1) * COLS * ITEM + ITEM);
        goto done;
    }
    TRY(cubuf_buffer_copy_to_host(column, 0, -1, span, sizeof span, 0, &n));
    for (int r = 0; r < ROWS; r++)
        if (span[r * COLS] != matrix[r][COL]) {
            fprintf(stderr, "column element %d is %d, not %d\n", r, (int)span[r * COLS],
                    (int)matrix[r][COL]);
            goto done;
        }
    for (int r = 0; r < ROWS; r++) { /* one 4-byte copy per element: the gaps stay as they are */
        int32_t v = -(r + 1);
        TRY(cubuf_buffer_copy_from_host(column, &v, sizeof v, r * COLS * ITEM, ITEM, 0, NULL));
    }

    /* The transpose: element [i][j] is matrix[j][i], so the strides swap too. */
    const int64_t t_shape[2] = {COLS, ROWS}, t_strides[2] = {ITEM, COLS * ITEM};
    TRY(cubuf_context_buffer_from_strided(ctx, a, 2, t_shape, t_strides, ITEM, buf, NULL, NULL,
                                          &trans));
    if (cubuf_buffer_size(trans) != sizeof matrix || cubuf_buffer_ptr(trans) != a) {
        fprintf(stderr, "the transposed view should span the whole buffer\n");
        goto done;
    }
    if ((st = cubuf_buffer_close(buf)) != CUBUF_ERROR_BUSY) {
        fprintf(stderr, "closing the base under open views gave %s\n", cubuf_status_name(st));
        goto done;
    }
    TRY(cubuf_buffer_copy_to_host(trans, 0, -1, span, sizeof span, 0, &n));
    /* Gather on the host by the view's strides: [i][j] lies at byte i*ITEM + j*COLS*ITEM. */
    for (int i = 0; i < COLS; i++)
        for (int j = 0; j < ROWS; j++) transposed[i][j] = span[i + j * COLS];
    for (int i = 0; i < COLS; i++)
        for (int j = 0; j < ROWS; j++) {
            int32_t want = i == COL ? -(j + 1) : matrix[j][i];
            if (transposed[i][j] != want) {
                fprintf(stderr, "transposed[%d][%d] is %d, not %d\n", i, j, (int)transposed[i][j],
                        (int)want);
                goto done;
            }
        }
    printf("the transposed view reads the matrix with column %d rewritten (%zu bytes)\n", COL, n);
    cubuf_buffer_release(column);
    cubuf_buffer_release(trans);
    column = trans = NULL;
    TRY(cubuf_buffer_close(buf)); /* the views are gone: now it closes */
    rc = 0;
done:
    cubuf_buffer_release(trans);
    cubuf_buffer_release(column);
    cubuf_buffer_release(buf);
    cubuf_context_destroy(ctx);
    return rc;
}
