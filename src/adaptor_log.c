/* The logging adaptor: one line per allocate and free (cubuf/adaptor.h).
 *
 * The hot path takes no lock. Each thread writes 32-byte entries (events,
 * and notes of what rarely changes: log_event_t) into a ring of its own
 * (one writer, one reader: the owner publishes with a release store, the
 * reader frees space the same way). The only shared
 * write is the order counter, one addition per free under a biased lock
 * (lock.h: no atomic for the thread that owns it). Times come from the
 * adaptor's writer thread, which stores the clock at least every
 * millisecond while events come (a load on the hot path, not a clock
 * read). The writer thread formats what the rings hold (by hand: snprintf
 * would make it slower than the threads it serves) and writes it; a thread
 * whose ring is half full wakes it, one whose ring is full waits for space,
 * and writes the log itself when the writer frees none for a while (a slow
 * callback), so memory stays bounded and a program that allocates faster
 * than its log can be written slows down.
 *
 * Order: a free takes its number from the counter before it asks the
 * upstream; an allocation reads the counter after the upstream returned.
 * An allocation that reuses freed memory runs after that free (the
 * upstream's own synchronization orders them), so it reads a count past
 * the free's number: allocations sort at 2 * count, frees at 2 * number + 1,
 * and every thread's events come out in its own order.
 *
 * Rings are found through a small per-thread cache keyed by the adaptor's
 * id (unique for the process's life, so a cache never names a dead
 * adaptor's ring); on a miss, under ring_lock, a thread takes its own ring
 * again, or one whose thread has exited, or a new one. No lock is taken
 * while another is held. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "adaptor_base.h"

#define LOG_RING_DEFAULT 16384      /* entries per thread (options->ring_events 0) */
#define LOG_RING_MIN 128            /* and the least and most a ring may hold */
#define LOG_RING_MAX (1u << 24)
#define LOG_CACHE 4                 /* adaptors a thread remembers its rings of */
#define LOG_TICK_NS 1000000         /* the writer's clock period while events come */
#define LOG_REST_NS 100000000       /* its period after LOG_QUIET_TICKS without one */
#define LOG_QUIET_TICKS 100
#define LOG_AHEAD 16                /* events ahead a thread asks for its ring's lines */
#define LOG_CHUNK 64                /* a write frees ring space this often */
#define LOG_TICK_CHUNKS 8           /* and a long one stores the clock this often */
#define LOG_FULL_WAIT_NS 2000000    /* a full ring's wait for space before its thread writes */

/* A ring entry, 32 bytes: two to a cache line. An event's order tells the
 * operation (even: an allocation, odd: a free). What changes rarely goes in
 * a note, an entry whose order is LOG_NOTE and which says, in stream, what
 * it sets to ptr for the events after it: the time (when it moved since
 * the thread's last event: once a millisecond while the writer's clock
 * ticks, at every event while it rests or with precise_time), the thread
 * (when a thread takes a ring that was another's), the status (a failed
 * operation's, for the next event only). A thread writes an event and its
 * notes, up to three entries, before it publishes them. */
typedef struct log_event {
    uint64_t order;
    CUstream stream;
    CUdeviceptr ptr;
    size_t size;
} log_event_t;

#define LOG_NOTE UINT64_MAX
enum { NOTE_TIME = 1, NOTE_THREAD, NOTE_STATUS };

/* What the notes have set, as the writer reads a ring. */
typedef struct log_state {
    uint64_t time;
    int32_t tid;
    int32_t status; /* the next event's */
} log_state_t;

typedef struct log_ring {
    /* The owner's line. */
    _Atomic uint64_t head; /* entries written */
    uint64_t check_at;     /* the head at which to look at the tail again */
    uint64_t poked_at;     /* the tail at which the writer was last woken */
    uint64_t last_time;    /* times never go back within a thread */
    int32_t tid;           /* the owner's (set under ring_lock when taken) */
    char pad0[128 - 40];
    /* The reader's line. */
    _Atomic uint64_t tail; /* entries written out */
    struct log_ring *next; /* the adaptor's list, prepended under ring_lock */
    log_state_t state;     /* under out_lock */
    char pad1[128 - 16 - sizeof(log_state_t)];
    log_event_t ev[]; /* the adaptor's ring_events entries */
} log_ring_t;
/* The ring is allocated on a 128-byte boundary: each group of fields has
 * lines of its own, and the entries two to a line. */
_Static_assert(offsetof(log_ring_t, ev) % 128 == 0, "the entries start on a line");

/* What the last line had, kept by the writer: a time, a thread and a
 * stream repeat from line to line (the time moves every millisecond), so
 * their text is copied rather than made again. */
typedef struct line_cache {
    uint64_t time;
    int32_t tid;
    CUstream stream;
    uint8_t time_len, tid_len, stream_len;
    char time_text[24], tid_text[24], stream_text[24]; /* room for what the puts write */
} line_cache_t;

/* Grouped by who writes what, each group on lines of its own (a thread
 * allocating reads the middle group at every event). */
typedef struct log_adaptor {
    char pad0[128];
    _Atomic uint64_t frees; /* the order counter: every free adds, under order_lock */
    cubuf_lock_t order_lock;
    char pad1[128 - 8 - sizeof(cubuf_lock_t)];
    _Atomic uint64_t now; /* the writer's clock, 0 while it rests */
    char pad2[120];
    /* Set at create. */
    uint64_t id;
    uint64_t ring; /* entries a ring holds, a power of two */
    bool precise;
    FILE *file;
    cubuf_log_line_fn callback;
    void *user;
    char pad3[128];
    /* The writers' and the slow paths'. */
    pthread_mutex_t out_lock; /* one writer at a time: the callback's calls never overlap */
    line_cache_t cache;       /* under out_lock */
    pthread_mutex_t ring_lock;
    _Atomic(log_ring_t *) rings;
    pthread_mutex_t q_lock; /* wake, stop */
    pthread_cond_t q_cond;
    bool wake, stop, writer_started;
    pthread_t writer;
} log_adaptor_t;

static int64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static cubuf_status_t write_events(log_adaptor_t *l, log_state_t *state, const log_event_t *ev, size_t n);
static inline uint64_t put(log_adaptor_t *l, log_ring_t *r, uint64_t h, uint64_t order, CUstream stream,
                           CUdeviceptr ptr, size_t size);
static cubuf_status_t write_rings(log_adaptor_t *l, bool tick, uint64_t *heads);

/* ---- finding the thread's ring ---- */

typedef struct ring_slot {
    uint64_t id;
    log_ring_t *ring;
} ring_slot_t;

/* What a thread keeps: its rings of the last adaptors it logged through,
 * and the adaptor whose line callback it is in (for the flush that callback
 * may ask for, which would wait for the output lock it runs under). */
typedef struct log_tls {
    ring_slot_t rings[LOG_CACHE];
    unsigned next_slot;
    const struct log_adaptor *in_callback;
} log_tls_t;

static _Thread_local log_tls_t tls;
static CUBUF_TLS_ACCESSOR log_tls_t *mine(void) { return &tls; }

/* Whether no thread of this process has kernel id `tid` now. A thread's
 * exit passes the kernel's barriers before its id stops being found, so
 * what it did with a ring is done (tasks cloned without CLONE_THREAD are
 * not threads of the process, and are not supported). */
static bool thread_gone(int32_t tid)
{
    const int e = errno;
    const bool gone = syscall(SYS_tgkill, (long)getpid(), (long)tid, 0L) != 0 && errno == ESRCH;
    errno = e;
    return gone;
}

/* The calling thread's ring, found or made under ring_lock; NULL when no
 * memory can be had for one. */
static log_ring_t *ring_slow(log_adaptor_t *l)
{
    const int32_t tid = cubuf__adaptor_thread_id();
    pthread_mutex_lock(&l->ring_lock);
    log_ring_t *first = atomic_load_explicit(&l->rings, memory_order_relaxed), *r = first;
    while (r && r->tid != tid) r = r->next; /* its own, or a dead thread's of the same id */
    for (log_ring_t *x = first; !r && x; x = x->next)
        if (thread_gone(x->tid)) r = x;
    const bool noted = r && r->tid == tid; /* its own ring: the notes name this thread already */
    if (r) {
        /* The last thing its last owner did was publish an event: reading
         * that makes all it did with the ring happen before what we do. */
        (void)atomic_load_explicit(&r->head, memory_order_acquire);
        r->tid = tid;
    } else if ((r = cubuf__aligned_alloc(128, sizeof *r + l->ring * sizeof r->ev[0]))) {
        memset(r, 0, offsetof(log_ring_t, ev));
        r->tid = tid;
        r->next = first;
        atomic_store_explicit(&l->rings, r, memory_order_release);
    }
    pthread_mutex_unlock(&l->ring_lock);
    if (r) {
        r->check_at = atomic_load_explicit(&r->tail, memory_order_acquire) + l->ring / 2;
        r->poked_at = UINT64_MAX;
        log_tls_t *t = mine();
        t->rings[t->next_slot++ % LOG_CACHE] = (ring_slot_t){l->id, r};
        if (!noted) { /* the events after this one are this thread's */
            const uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
            const uint64_t next = put(l, r, h, LOG_NOTE, (CUstream)(uintptr_t)NOTE_THREAD,
                                      (CUdeviceptr)(uint32_t)tid, 0);
            atomic_store_explicit(&r->head, next, memory_order_release);
        }
    }
    return r;
}

static inline log_ring_t *ring_of(log_adaptor_t *l)
{
    const ring_slot_t *rings = mine()->rings;
    for (int i = 0; i < LOG_CACHE; i++)
        if (rings[i].id == l->id) return rings[i].ring;
    return ring_slow(l);
}

/* ---- the hot path ---- */

static void poke(log_adaptor_t *l)
{
    pthread_mutex_lock(&l->q_lock);
    l->wake = true;
    pthread_cond_signal(&l->q_cond);
    pthread_mutex_unlock(&l->q_lock);
}

static void warn_lost(void)
{
    cubuf__warn(CUBUF_ERROR_SYSTEM, "logging adaptor: a write failed; its events are lost: %s",
                cubuf_last_error());
}

/* An event that has no ring, written at once (after what the rings hold).
 * On the allocating thread: a failed write is a warning, and the thread's
 * error detail stays the call's own (cubuf__error_save). */
static void write_alone(log_adaptor_t *l, const log_event_t *e, log_state_t *state)
{
    cubuf_error_saved_t saved;
    cubuf__error_save(&saved);
    pthread_mutex_lock(&l->out_lock);
    cubuf_status_t st = write_rings(l, false, NULL);
    if (st == CUBUF_SUCCESS) st = write_events(l, state, e, 1);
    pthread_mutex_unlock(&l->out_lock);
    if (st != CUBUF_SUCCESS) warn_lost();
    cubuf__error_restore(&saved);
}

/* Asks for the line at p to be owned for writing. The writer thread read
 * each slot of a ring a lap earlier, so writing one needs the line back
 * from its core; asked for ahead, that wait overlaps other work instead of
 * holding up the next atomic (which waits for every earlier store). */
static inline void prefetch_write(const void *p)
{
#if defined(__x86_64__)
    __asm__ volatile("prefetchw %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 1);
#endif
}

/* The thread has written up to check_at: look at the tail, which the
 * writer moves a chunk (LOG_CHUNK events) at a time. At least half full:
 * wake the writer once per tail it has left, and when full, wait while it
 * frees space, spinning and yielding now and then; after LOG_FULL_WAIT_NS
 * without space, write the log here if nobody is writing it (whoever is, a
 * slow callback included, frees space as it goes: the thread keeps waiting,
 * at the writer's pace). Then set when to look again: at half full, or past
 * it a chunk later, never past full. Looking at every event past half full
 * would read the writer's line at every event while it works. */
static void make_room(log_adaptor_t *l, log_ring_t *r, uint64_t h)
{
    const uint64_t ring = l->ring;
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    if (h - tail >= ring / 2 && r->poked_at != tail) {
        r->poked_at = tail;
        poke(l);
    }
    int64_t give_up = 0;
    for (unsigned i = 1; h - tail >= ring; i++) {
        for (int k = 0; k < 32; k++) cubuf__cpu_relax();
        if (i % 64 == 0) sched_yield(); /* the writer may share this core */
        if (i % 16 == 0) {
            const int64_t now = mono_ns();
            if (!give_up) give_up = now + LOG_FULL_WAIT_NS;
            if (now > give_up && pthread_mutex_trylock(&l->out_lock) == 0) {
                cubuf_error_saved_t saved; /* as in write_alone */
                cubuf__error_save(&saved);
                const cubuf_status_t st = write_rings(l, false, NULL);
                pthread_mutex_unlock(&l->out_lock);
                if (st != CUBUF_SUCCESS) warn_lost();
                cubuf__error_restore(&saved);
                give_up = 0;
            }
        }
        tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    }
    if (h - tail < ring / 2) r->check_at = tail + ring / 2;
    else r->check_at = h + LOG_CHUNK < tail + ring ? h + LOG_CHUNK : tail + ring;
}

/* Stores an entry at h, room made; returns the next slot. */
static inline uint64_t put(log_adaptor_t *l, log_ring_t *r, uint64_t h, uint64_t order, CUstream stream,
                           CUdeviceptr ptr, size_t size)
{
    if (__builtin_expect(h >= r->check_at, 0)) make_room(l, r, h);
    log_event_t *e = &r->ev[h & (l->ring - 1)];
    e->order = order;
    e->stream = stream;
    e->ptr = ptr;
    e->size = size;
    return h + 1;
}

static void record(log_adaptor_t *l, uint64_t order, CUstream stream, CUdeviceptr ptr, size_t size,
                   cubuf_status_t st)
{
    log_ring_t *r = ring_of(l);
    uint64_t t = l->precise ? 0 : atomic_load_explicit(&l->now, memory_order_relaxed);
    if (__builtin_expect(!t, 0)) t = (uint64_t)mono_ns(); /* precise, or the writer rests */
    if (__builtin_expect(!r, 0)) {
        /* No ring (no memory for one): written now, its time not held back
         * to the thread's last. */
        log_event_t e = {order, stream, ptr, size};
        log_state_t state = {t, cubuf__adaptor_thread_id(), (int32_t)st};
        write_alone(l, &e, &state);
        return;
    }
    const uint64_t h0 = atomic_load_explicit(&r->head, memory_order_relaxed);
    uint64_t h = h0;
    if (__builtin_expect(t > r->last_time, 0)) { /* never back within a thread */
        r->last_time = t;
        h = put(l, r, h, LOG_NOTE, (CUstream)(uintptr_t)NOTE_TIME, t, 0);
    }
    if (__builtin_expect(st != CUBUF_SUCCESS, 0))
        h = put(l, r, h, LOG_NOTE, (CUstream)(uintptr_t)NOTE_STATUS, (CUdeviceptr)(uint32_t)st, 0);
    h = put(l, r, h, order, stream, ptr, size);
    prefetch_write(&r->ev[(h0 + LOG_AHEAD) & (l->ring - 1)]);
    atomic_store_explicit(&r->head, h, memory_order_release);
}

static cubuf_status_t log_allocate(cubuf_resource_t *res, cubuf_buffer_t *buf, CUstream stream,
                                   bool in_ctx, cubuf_charge_t *charge)
{
    log_adaptor_t *l = res->impl;
    cubuf_status_t st = cubuf__adaptor_up_allocate(res, buf, stream, in_ctx, charge);
    /* Relaxed is enough: a free whose memory this reuses happened before
     * (through the upstream), and coherence then shows its count. */
    const uint64_t seen = atomic_load_explicit(&l->frees, memory_order_relaxed);
    record(l, 2 * seen, buf->dealloc.stream, st == CUBUF_SUCCESS ? buf->ptr : 0, buf->size,
           st);
    return st;
}

static cubuf_status_t log_deallocate(cubuf_resource_t *res, cubuf_buffer_t *buf,
                                     const cubuf_stream_token_t *token, cubuf_charge_t *charge)
{
    log_adaptor_t *l = res->impl;
    /* Before the upstream frees: its release orders this add before any
     * reuse. Under the (biased) lock rather than an atomic add: the thread
     * that owns it adds with plain stores; allocations only load. */
    cubuf__lock(&l->order_lock);
    const uint64_t number = atomic_load_explicit(&l->frees, memory_order_relaxed);
    atomic_store_explicit(&l->frees, number + 1, memory_order_relaxed);
    cubuf__unlock(&l->order_lock);
    cubuf_status_t st = cubuf__adaptor_up_deallocate(res, buf, token, charge);
    record(l, 2 * number + 1, token->stream, buf->ptr, buf->size, st);
    return st;
}

/* ---- formatting ---- */

static const char two_digits[] = "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
                                 "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
                                 "8081828384858687888990919293949596979899";

/* Fields are made in registers and stored 8 bytes at a time, p advancing
 * by the field's length: what a store writes past the field, the next
 * field overwrites, and a line has room past its end (LOG_LINE_MAX). The
 * words are little-endian: the first character in the lowest byte. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the log's formatting assumes a little-endian machine"
#endif

/* The decimal digits of v (1 to 20). */
static inline int dec_digits(uint64_t v)
{
    static const uint64_t pow10[20] = {1,
                                       10,
                                       100,
                                       1000,
                                       10000,
                                       100000,
                                       1000000,
                                       10000000,
                                       100000000,
                                       1000000000,
                                       10000000000ull,
                                       100000000000ull,
                                       1000000000000ull,
                                       10000000000000ull,
                                       100000000000000ull,
                                       1000000000000000ull,
                                       10000000000000000ull,
                                       100000000000000000ull,
                                       1000000000000000000ull,
                                       10000000000000000000ull};
    const int guess = ((64 - __builtin_clzll(v | 1)) * 1233) >> 12; /* log10 of 2^bits */
    return guess + 1 - (guess > 0 && v < pow10[guess]); /* 0 has one digit too */
}

static inline uint64_t pair_word(uint32_t v) /* v < 100: its two digits */
{
    uint16_t w;
    memcpy(&w, two_digits + 2 * v, 2);
    return w;
}

/* v < 10^8 as the 8 characters of its digits, leading zeros included. */
static inline uint64_t digits8(uint32_t v)
{
    const uint32_t hi = v / 10000, lo = v % 10000;
    return pair_word(hi / 100) | pair_word(hi % 100) << 16 | pair_word(lo / 100) << 32 |
           pair_word(lo % 100) << 48;
}

static inline char *put_word(char *p, uint64_t w, int n)
{
    memcpy(p, &w, 8);
    return p + n;
}

/* v in decimal, as printf's %llu writes it. */
static char *put_big(char *p, uint64_t v);
static inline char *put_u64(char *p, uint64_t v)
{
    if (__builtin_expect(v >= 100000000, 0)) return put_big(p, v);
    const int n = dec_digits(v);
    return put_word(p, digits8((uint32_t)v) >> (8 * (8 - n)), n);
}
static char *put_big(char *p, uint64_t v)
{
    p = put_u64(p, v / 100000000);
    return put_word(p, digits8((uint32_t)(v % 100000000)), 8);
}

/* The 8 hex characters of v, most significant first. */
static inline uint64_t hex8(uint32_t v)
{
    uint64_t x = v;
    x = (x | x << 16) & 0x0000ffff0000ffffull;
    x = (x | x << 8) & 0x00ff00ff00ff00ffull;
    x = (x | x << 4) & 0x0f0f0f0f0f0f0f0full; /* a nibble a byte, the lowest first */
    x = __builtin_bswap64(x);
    const uint64_t letters = ((x + 0x0606060606060606ull) >> 4) & 0x0101010101010101ull;
    return x + 0x3030303030303030ull + letters * ('a' - '0' - 10);
}

/* v in hex, as printf's 0x%llx writes it. */
static inline char *put_hex(char *p, uint64_t v)
{
    const int n = v ? (67 - __builtin_clzll(v)) / 4 : 1;
    p = put_word(p, 0x7830, 2); /* "0x" */
    const uint64_t lo = hex8((uint32_t)v);
    if (n <= 8) return put_word(p, lo >> (8 * (8 - n)), n);
    p = put_word(p, hex8((uint32_t)(v >> 32)) >> (8 * (16 - n)), n - 8);
    return put_word(p, lo, 8);
}

static inline char *put_str(char *p, const char *str, size_t n)
{
    memcpy(p, str, n);
    return p + n;
}

/* One event's line, without its newline, into p (at most LOG_LINE_MAX
 * bytes); returns its end. */
#define LOG_LINE_MAX 192
static char *format_event(char *p, const log_event_t *e, const log_state_t *s, line_cache_t *c)
{
    static const char ok[] = "CUBUF_SUCCESS";
    p = put_u64(p, e->order);
    *p++ = ',';
    if (s->time != c->time || !c->time_len) {
        c->time = s->time;
        c->time_len = (uint8_t)(put_u64(c->time_text, s->time) - c->time_text);
    }
    memcpy(p, c->time_text, sizeof c->time_text);
    p += c->time_len;
    *p++ = ',';
    if (s->tid != c->tid || !c->tid_len) {
        char *t = c->tid_text;
        if (s->tid < 0) *t++ = '-';
        t = put_u64(t, s->tid < 0 ? -(uint64_t)(int64_t)s->tid : (uint64_t)s->tid);
        c->tid = s->tid;
        c->tid_len = (uint8_t)(t - c->tid_text);
    }
    memcpy(p, c->tid_text, sizeof c->tid_text);
    p += c->tid_len;
    *p++ = ',';
    if (e->stream != c->stream || !c->stream_len) {
        char *t = e->stream ? put_hex(c->stream_text, (uint64_t)(uintptr_t)e->stream)
                            : put_str(c->stream_text, "(nil)", 5);
        c->stream = e->stream;
        c->stream_len = (uint8_t)(t - c->stream_text);
    }
    memcpy(p, c->stream_text, sizeof c->stream_text);
    p += c->stream_len;
    p = e->order & 1 ? put_str(p, ",free,", 6) : put_str(p, ",allocate,", 10);
    p = put_hex(p, e->ptr);
    *p++ = ',';
    p = put_u64(p, e->size);
    *p++ = ',';
    if (s->status == CUBUF_SUCCESS) return put_str(p, ok, sizeof ok - 1);
    const char *name = cubuf_status_name((cubuf_status_t)s->status);
    return put_str(p, name, strlen(name));
}

/* ---- writing ---- */

static cubuf_status_t write_failed(void)
{
    return cubuf__fail(CUBUF_ERROR_SYSTEM, "logging adaptor: cannot write the log: %s", strerror(errno));
}

static void call_back(log_adaptor_t *l, const char *line)
{
    log_tls_t *t = mine();
    const log_adaptor_t *outer = t->in_callback;
    t->in_callback = l;
    l->callback(l->user, line);
    t->in_callback = outer;
}

static cubuf_status_t emit(log_adaptor_t *l, const char *line)
{
    if (l->callback) {
        call_back(l, line);
        return CUBUF_SUCCESS;
    }
    if (fputs(line, l->file) < 0 || fputc('\n', l->file) < 0) return write_failed();
    return CUBUF_SUCCESS;
}

/* Applies a note to *state; false for an event. */
static inline bool take_note(const log_event_t *e, log_state_t *state)
{
    if (e->order != LOG_NOTE) return false;
    switch ((uintptr_t)e->stream) {
    case NOTE_TIME: state->time = e->ptr; break;
    case NOTE_THREAD: state->tid = (int32_t)(uint32_t)e->ptr; break;
    case NOTE_STATUS: state->status = (int32_t)(uint32_t)e->ptr; break;
    }
    return true;
}

/* Writes n events, the output lock held, with what the notes among them
 * set in *state (a status for one event only). A callback gets a line at a
 * time, marked as this thread's callback of l for the whole batch; a file
 * gets them in large writes (flushed by flush()). */
static cubuf_status_t write_events(log_adaptor_t *l, log_state_t *state, const log_event_t *ev, size_t n)
{
    char out[16 * 1024];
    if (l->callback) {
        log_tls_t *t = mine();
        const log_adaptor_t *outer = t->in_callback;
        t->in_callback = l;
        for (size_t i = 0; i < n; i++) {
            if (take_note(&ev[i], state)) continue;
            *format_event(out, &ev[i], state, &l->cache) = '\0';
            state->status = CUBUF_SUCCESS;
            l->callback(l->user, out);
        }
        t->in_callback = outer;
        return CUBUF_SUCCESS;
    }
    size_t used = 0;
    for (size_t i = 0; i < n; i++) {
        if (take_note(&ev[i], state)) continue;
        char *end = format_event(out + used, &ev[i], state, &l->cache);
        state->status = CUBUF_SUCCESS;
        *end++ = '\n';
        used = (size_t)(end - out);
        if (used > sizeof out - LOG_LINE_MAX) {
            if (fwrite(out, 1, used, l->file) != used) {
                while (++i < n) (void)take_note(&ev[i], state); /* for the events after these */
                return write_failed();
            }
            used = 0;
        }
    }
    if (used && fwrite(out, 1, used, l->file) != used) return write_failed();
    return CUBUF_SUCCESS;
}

/* Writes what every ring holds, the output lock held; the space goes back
 * to the ring's thread even where a write fails (those events are lost).
 * The writer thread (`tick`) stores the clock every LOG_TICK_CHUNKS
 * chunks. `heads`, if set, gets the sum of the rings' heads. */
static cubuf_status_t write_rings(log_adaptor_t *l, bool tick, uint64_t *heads)
{
    cubuf_status_t st = CUBUF_SUCCESS;
    uint64_t sum = 0;
    for (log_ring_t *r = atomic_load_explicit(&l->rings, memory_order_acquire); r; r = r->next) {
        const uint64_t h = atomic_load_explicit(&r->head, memory_order_acquire);
        uint64_t t = atomic_load_explicit(&r->tail, memory_order_relaxed);
        sum += h;
        for (unsigned chunk = 1; t < h; chunk++) {
            const size_t at = (size_t)(t & (l->ring - 1));
            size_t n = (size_t)(h - t);
            if (n > l->ring - at) n = (size_t)(l->ring - at);
            if (n > LOG_CHUNK) n = LOG_CHUNK;
            cubuf_status_t wst = write_events(l, &r->state, &r->ev[at], n);
            if (st == CUBUF_SUCCESS) st = wst;
            t += n;
            atomic_store_explicit(&r->tail, t, memory_order_release);
            if (tick && chunk % LOG_TICK_CHUNKS == 0)
                atomic_store_explicit(&l->now, (uint64_t)mono_ns(), memory_order_relaxed);
        }
    }
    if (heads) *heads = sum;
    return st;
}

/* The writer thread: the clock every LOG_TICK_NS while events come (every
 * LOG_REST_NS, with `now` 0, after a quiet spell), and what the rings hold. */
static void *writer_main(void *arg)
{
    log_adaptor_t *l = arg;
    uint64_t last_heads = 0;
    unsigned quiet = 0;
    bool resting = false;
    pthread_mutex_lock(&l->q_lock);
    while (!l->stop) {
        if (!l->wake) {
            const int64_t at_ns = mono_ns() + (resting ? LOG_REST_NS : LOG_TICK_NS);
            const struct timespec at = {at_ns / 1000000000, at_ns % 1000000000};
            pthread_cond_timedwait(&l->q_cond, &l->q_lock, &at);
        }
        l->wake = false;
        pthread_mutex_unlock(&l->q_lock);
        if (!resting) atomic_store_explicit(&l->now, (uint64_t)mono_ns(), memory_order_relaxed);
        uint64_t heads = 0;
        pthread_mutex_lock(&l->out_lock);
        cubuf_status_t st = write_rings(l, !resting, &heads);
        pthread_mutex_unlock(&l->out_lock);
        if (st != CUBUF_SUCCESS)
            cubuf__warn(CUBUF_ERROR_SYSTEM, "logging adaptor: a write failed: %s", cubuf_last_error());
        if (heads != last_heads) {
            last_heads = heads;
            quiet = 0;
            if (resting) atomic_store_explicit(&l->now, (uint64_t)mono_ns(), memory_order_relaxed);
            resting = false;
        } else if (!resting && ++quiet >= LOG_QUIET_TICKS) {
            resting = true;
            atomic_store_explicit(&l->now, 0, memory_order_relaxed);
        }
        pthread_mutex_lock(&l->q_lock);
    }
    pthread_mutex_unlock(&l->q_lock);
    return NULL;
}

/* Everything so far, then the file flushed. */
static cubuf_status_t flush(log_adaptor_t *l)
{
    pthread_mutex_lock(&l->out_lock);
    cubuf_status_t st = write_rings(l, false, NULL);
    if (l->file && fflush(l->file) != 0 && st == CUBUF_SUCCESS) st = write_failed();
    pthread_mutex_unlock(&l->out_lock);
    return st;
}

/* Frees what a (partly) made adaptor holds besides the resource. */
static void log_free(log_adaptor_t *l)
{
    for (log_ring_t *r = atomic_load(&l->rings), *next; r; r = next) {
        next = r->next;
        free(r);
    }
    if (l->file) fclose(l->file);
    pthread_cond_destroy(&l->q_cond);
    pthread_mutex_destroy(&l->q_lock);
    pthread_mutex_destroy(&l->ring_lock);
    pthread_mutex_destroy(&l->out_lock);
}

static void log_destroy(cubuf_resource_t *res)
{
    log_adaptor_t *l = res->impl;
    if (l->writer_started) {
        pthread_mutex_lock(&l->q_lock);
        l->stop = true;
        pthread_cond_signal(&l->q_cond);
        pthread_mutex_unlock(&l->q_lock);
        pthread_join(l->writer, NULL);
    }
    if (flush(l) != CUBUF_SUCCESS)
        cubuf__warn(CUBUF_ERROR_SYSTEM, "logging adaptor: the last flush failed: %s", cubuf_last_error());
    log_free(l);
    cubuf__adaptor_destroy(res);
}

static const cubuf_resource_vtbl_t log_vtbl = {
    .name = "logging adaptor",
    .no_adopt = cubuf__adaptor_no_adopt,
    .no_export = cubuf__adaptor_no_export,
    .passes_stats = true,
    .allocate = log_allocate,
    .deallocate = log_deallocate,
    .destroy = log_destroy,
};

cubuf_status_t cubuf_log_adaptor_create(cubuf_resource_t *upstream, const cubuf_log_options_t *options,
                                        cubuf_resource_t **out)
{
    static const char what[] = "cubuf_log_adaptor_create";
    static _Atomic uint64_t next_id = 1;
    CHECK_ARG(upstream && options && out, "%s: NULL argument", what);
    cubuf_log_options_t o = CUBUF_LOG_OPTIONS_INIT;
    cubuf_status_t st = cubuf__struct_in(what, "cubuf_log_options_t", &o, sizeof o, options,
                                         CUBUF_LOG_OPTIONS_SIZE_V1);
    if (st != CUBUF_SUCCESS) return st;
    CHECK_ARG(!o.path != !o.callback, "%s: set exactly one of path and callback", what);
    if (!o.ring_events) o.ring_events = LOG_RING_DEFAULT;
    CHECK_ARG(o.ring_events >= LOG_RING_MIN && o.ring_events <= LOG_RING_MAX &&
                  !(o.ring_events & (o.ring_events - 1)),
              "%s: ring_events %zu is not 0 or a power of two from %u to %u", what, o.ring_events,
              (unsigned)LOG_RING_MIN, (unsigned)LOG_RING_MAX);
    FILE *f = NULL;
    if (o.path && !(f = fopen(o.path, "we"))) {
        int e = errno;
        return cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: cannot open %s: %s", what, o.path, strerror(e));
    }
    cubuf_resource_t *res = NULL;
    if ((st = cubuf__adaptor_new(upstream, &log_vtbl, sizeof(log_adaptor_t), what, &res)) != CUBUF_SUCCESS) {
        if (f) fclose(f);
        return st;
    }
    log_adaptor_t *l = res->impl;
    l->id = atomic_fetch_add(&next_id, 1);
    l->ring = o.ring_events;
    l->precise = o.precise_time;
    l->file = f;
    l->callback = o.callback;
    l->user = o.user;
    pthread_mutex_init(&l->out_lock, NULL);
    pthread_mutex_init(&l->ring_lock, NULL);
    pthread_mutex_init(&l->q_lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->q_cond, &ca);
    pthread_condattr_destroy(&ca);
    atomic_store(&l->now, (uint64_t)mono_ns());
    st = emit(l, "# cubuf log 2: order,time_ns,thread,stream,operation,pointer,size,status");
    if (st == CUBUF_SUCCESS) {
        int e = pthread_create(&l->writer, NULL, writer_main, l);
        if (e) st = cubuf__fail(CUBUF_ERROR_SYSTEM, "%s: cannot start the writer thread: %s", what, strerror(e));
        l->writer_started = e == 0;
    }
    if (st != CUBUF_SUCCESS) {
        cubuf_resource_release(res); /* log_destroy copes with a part-made adaptor */
        return st;
    }
    *out = res;
    return CUBUF_SUCCESS;
}

cubuf_status_t cubuf_log_adaptor_flush(cubuf_resource_t *res)
{
    CHECK_ARG(res && res->vt == &log_vtbl, "cubuf_log_adaptor_flush: not a logging adaptor");
    if (mine()->in_callback == res->impl)
        return cubuf__fail(CUBUF_ERROR_BUSY, "cubuf_log_adaptor_flush: called from the adaptor's own "
                                             "line callback, while it writes");
    return flush(res->impl);
}
