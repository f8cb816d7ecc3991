/* The spin lock of the hot paths (lock.c), biased to the first thread that
 * takes it. Private: never installed.
 *
 * It guards critical sections of a few stores: a resource stack's counts
 * and references, the caching resource's per-stream lists, the tracking
 * adaptor's shards, the log's order. Taken through a lock word, a section
 * costs one atomic read-modify-write, about 10 ns on the H200's host, and
 * that was most of what an adaptor added to an allocate + free. Most locks
 * are only ever taken by one thread, so the first thread to take a lock
 * owns it: its sections raise a flag of the lock's with plain stores and
 * leave the word alone. The first other thread to take the lock takes the
 * word, marks the lock shared for good, makes every thread of the process
 * pass a memory barrier (membarrier(2), a few microseconds once) and waits
 * until the owner is out of its section; from then on everyone takes the
 * word. That barrier is the owner's fence: the owner's flag store and its
 * second look at the owner field (a store then a load, which a CPU may
 * reorder) either both come before it, and the revoking thread sees the
 * flag, or the look comes after, and sees the lock shared (an asymmetric
 * Dekker handshake, as user-space RCU does it). The process registers for
 * that barrier when cubuf loads (lock.c). Where membarrier is missing, or
 * CUBUF_LOCK_BIAS=0 is in the environment, every lock is shared from the
 * start.
 *
 * A zeroed cubuf_lock_t is an unlocked lock. The holder notes in the lock
 * how it entered (`owned`, guarded by the lock itself: written after
 * entering, read before leaving), for its unlock. */
#ifndef CUBUF_LOCK_H
#define CUBUF_LOCK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct cubuf_lock {
    _Atomic uintptr_t owner; /* 0: no owner yet; CUBUF_LOCK_SHARED; else the owner's cubuf__lock_self */
    atomic_bool busy;       /* the owner is in a section (written by the owner only) */
    atomic_bool word;       /* the lock word of the shared lock */
    bool owned;             /* the holder entered as the owner */
} cubuf_lock_t;

#define CUBUF_LOCK_SHARED UINTPTR_MAX

/* A thread's identity: its thread pointer (what pthread_self gives), one
 * register read. A thread started after an owner exited may get the same
 * one, and then owns its locks: that is safe, as the old owner is in no
 * section and its last one happened before the new thread could start. */
uintptr_t cubuf__lock_self_slow(void); /* pthread_self() */
static inline uintptr_t cubuf__lock_self(void)
{
#if defined(__x86_64__) || defined(__aarch64__)
    return (uintptr_t)__builtin_thread_pointer();
#else
    return cubuf__lock_self_slow();
#endif
}

/* A spinning thread's pause (the log's full ring waits with it too). */
static inline void cubuf__cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* The owner's entry: the flag, then a second look (see above). */
static inline bool cubuf__lock_enter_owned(cubuf_lock_t *l, uintptr_t self)
{
    atomic_store_explicit(&l->busy, true, memory_order_relaxed);
    atomic_signal_fence(memory_order_seq_cst); /* the revoking thread's membarrier is the fence */
    if (__builtin_expect(atomic_load_explicit(&l->owner, memory_order_relaxed) == self, 1)) return true;
    atomic_store_explicit(&l->busy, false, memory_order_release); /* revoked meanwhile */
    return false;
}

/* Whether locks are biased in this process (lock.c: membarrier, CUBUF_LOCK_BIAS). */
bool cubuf__lock_bias_on(void);

/* Claims the lock, or takes its word (revoking an owner); true when it
 * entered as the owner. */
bool cubuf__lock_slow(cubuf_lock_t *l);

static inline void cubuf__lock(cubuf_lock_t *l)
{
    const uintptr_t o = atomic_load_explicit(&l->owner, memory_order_relaxed);
    l->owned = (o != CUBUF_LOCK_SHARED && o == cubuf__lock_self() && cubuf__lock_enter_owned(l, o)) ||
               cubuf__lock_slow(l);
}

static inline void cubuf__unlock(cubuf_lock_t *l)
{
    atomic_store_explicit(l->owned ? &l->busy : &l->word, false, memory_order_release);
}

#endif
