/* Status names and strings, the thread-local detail, warnings. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *cubuf_status_name(cubuf_status_t status)
{
    switch (status) {
#define CUBUF_NAME_CASE_(name, value, text) \
    case CUBUF_##name: return "CUBUF_" #name;
        CUBUF_STATUS_MAP(CUBUF_NAME_CASE_)
#undef CUBUF_NAME_CASE_
    }
    return "CUBUF_UNKNOWN_STATUS";
}

const char *cubuf_status_string(cubuf_status_t status)
{
    switch (status) {
#define CUBUF_TEXT_CASE_(name, value, text) \
    case CUBUF_##name: return text;
        CUBUF_STATUS_MAP(CUBUF_TEXT_CASE_)
#undef CUBUF_TEXT_CASE_
    }
    return "unknown status";
}

typedef struct error_tls {
    char last_error[CUBUF__DETAIL_MAX];
    CUresult last_cu;
} error_tls_t;

static _Thread_local error_tls_t tls;
static CUBUF_TLS_ACCESSOR error_tls_t *mine(void) { return &tls; }

const char *cubuf_last_error(void) { return mine()->last_error; }
CUresult cubuf_last_cuda_result(void) { return mine()->last_cu; }
void cubuf__set_last_cu(CUresult r) { mine()->last_cu = r; }
void cubuf__detail_clear(void) { mine()->last_error[0] = '\0'; }

void cubuf__error_save(cubuf_error_saved_t *s)
{
    const error_tls_t *t = mine();
    memcpy(s->detail, t->last_error, sizeof s->detail);
    s->cu = t->last_cu;
}

void cubuf__error_restore(const cubuf_error_saved_t *s)
{
    error_tls_t *t = mine();
    memcpy(t->last_error, s->detail, sizeof t->last_error);
    t->last_cu = s->cu;
}

cubuf_status_t cubuf__fail(cubuf_status_t st, const char *fmt, ...)
{
    /* The detail may be built from the previous one (vsnprintf from itself is
     * undefined), so format into a scratch buffer first. */
    error_tls_t *t = mine();
    char tmp[CUBUF__DETAIL_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(t->last_error, tmp, sizeof tmp);
    if (!strstr(tmp, "failed: CUDA_ERROR") && !strstr(tmp, "failed: CUresult"))
        t->last_cu = CUDA_SUCCESS;
    return st;
}

void cubuf__detail_append(const char *fmt, ...)
{
    char *last_error = mine()->last_error;
    size_t n = strlen(last_error);
    if (n + 4 >= CUBUF__DETAIL_MAX) return;
    last_error[n++] = ' ';
    last_error[n++] = '(';
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, CUBUF__DETAIL_MAX - n - 1, fmt, ap);
    va_end(ap);
    n = strlen(last_error);
    if (n + 1 < CUBUF__DETAIL_MAX) {
        last_error[n] = ')';
        last_error[n + 1] = '\0';
    }
}

/* Warnings are rare: a mutex keeps the handler and its user pointer together. */
static pthread_mutex_t handler_lock = PTHREAD_MUTEX_INITIALIZER;
static cubuf_warning_fn handler_fn;
static void *handler_user;

void cubuf_set_warning_handler(cubuf_warning_fn fn, void *user)
{
    pthread_mutex_lock(&handler_lock);
    handler_fn = fn;
    handler_user = fn ? user : NULL;
    pthread_mutex_unlock(&handler_lock);
}

void cubuf__warn(cubuf_status_t st, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&handler_lock);
    cubuf_warning_fn fn = handler_fn;
    void *user = handler_user;
    pthread_mutex_unlock(&handler_lock);
    if (fn)
        fn(st, msg, user);
    else
        fprintf(stderr, "cubuf warning: %s: %s\n", cubuf_status_name(st), msg);
}
